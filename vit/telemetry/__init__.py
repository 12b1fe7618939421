"""What a run leaves behind: JSON-lines metrics, the GPU/CPU monitor, trackers,
config/cluster/summary files, and the readers behind plot_logs.py."""
