"""The Composer: a local web UI over the config schema, the memory estimate (`tokenmill.estimate`), the
reward preview and the runs' metrics streams.

Nothing heavy is imported here; the server modules are imported only by `tokenmill composer`.
"""
