"""Where a run executes: the launcher's environment and the process group, devices, precision, the
checks once the group is up, failure propagation, run folders and the quiet console."""
