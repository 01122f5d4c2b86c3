"""The Composer: a local web UI over the config schema, the memory estimate and the metrics stream.

Nothing heavy is imported here: `tokenmill.composer.memory` (the estimator, also behind `tokenmill estimate`)
needs no torch, and the server modules are imported only by `tokenmill composer`.
"""
