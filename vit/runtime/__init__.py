"""Where a run executes: the launcher's environment and the process group, devices, precision, the
checks once the group is up, failure propagation, the quiet console, the test plugins and the
simulated slowdown."""
