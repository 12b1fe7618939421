"""Reading finished or running runs back: the run folders' records (runlogs) and the charts,
comparison table and report behind plot_logs.py (charts)."""
