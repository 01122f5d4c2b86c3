"""Run health: is the run able to learn (engine-trainer mismatch, weight-sync probe, alarms, efficiency report);
`monitors.Monitors` is how the loop calls them."""
