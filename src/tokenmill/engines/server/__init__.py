"""`tokenmill serve`: an OpenAI-compatible HTTP server over a `ContinuousEngine`. `app` builds the FastAPI app
and runs it; `openai_wire` and `streaming` speak the OpenAI wire format; `weight_routes` receives pushed
weights; `proxy_routes` and `recorder` record agent episodes (proxy mode). Nothing here is imported by
`engines.local`: the server sits on top of an engine."""
