"""Scale-out on Ray (`pip install 'tokenmill[ray]'`): a cluster joined or started with safe defaults, engine
servers and trainer ranks as actors, a placement plan, restart on failure. The only package that imports Ray.
See docs/scale-out.md."""
