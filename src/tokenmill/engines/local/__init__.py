"""In-process engines: the model runs in this process (or a worker process of it). `hf.HFEngine` decodes a
whole batch at once; `continuous.ContinuousEngine` admits requests between steps (what `tokenmill serve` runs);
`sampling` is the one top-k / top-p kernel both sample with; `fast_decode` and `cuda_graphs` are the one-token
decode step; `prefix_cache`, `scoring`, `partial` and `worker` add to an engine what their names say."""
