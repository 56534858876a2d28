"""Processes: multi-host start-up, heartbeats and the step watchdog, the compile cache and GPU flags."""
