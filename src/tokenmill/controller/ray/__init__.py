"""Scale-out on Ray (`pip install 'tokenmill[ray]'`): a cluster joined or started with safe defaults, engine
servers and trainer ranks as actors, restart on failure (the placement plan, which needs no Ray, is
tokenmill.config.cluster.make_plan). The only package that imports Ray.
See docs/scale-out.md."""
