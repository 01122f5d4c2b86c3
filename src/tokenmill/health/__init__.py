"""Run health: is the run able to learn (engine-trainer mismatch, weight-sync probe, alarms)."""
