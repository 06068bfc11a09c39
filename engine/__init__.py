"""engine: what runs a step.

The torch-free driver, `core.py` (`EngineCore`: the step scheduler driving an executor;
`request_of`, a gateway task's request for every role; with `collect_model_time` it
charges each step's model time to the step's requests), takes its arguments from
`config.py` (`EngineConfig`, a msgspec Struct). The seam's messages are in
`step_plan.py` and its protocol in `executor.py`.

Behind the seam, one rank (`worker.py`: model, KV cache, runner, sampler, CUDA graphs;
`device_runner.py`: a step on a CUDA device, graph replay or eager) or a tensor- and
pipeline-parallel group of them (`worker_group.py`, `parallel.py`, `pipeline.py`;
`rendezvous.py`: the group's store on its interface, keys behind the secret). How
ranks start and what carries their messages: `ranks.py`'s `RankLauncher` (child
processes with a pipe each by default); which GPU each rank uses: `devices.py`.

Also here: the model definitions (`models/`), checkpoints and loading (`checkpoint.py`,
`loader.py`, `safetensors_reader.py`; a checkpoint's own `quantization_config` is
refused by name; an FP8 KV cache's per-layer scales: `kv_scales.py`), weight-only int8
applied at load (`models/int8.py`: `--quantization
int8`, each decoder layer's matrices int8 with one scale per group of 16 inputs,
quantized as their tensors are read), the embedded model (`embedded.py`), where a
model's files are (`model_source.py`: a folder, a GGUF file, or a Hugging Face id from
the hub cache); GGUF files served in their own blocks (`gguf_file.py`: the file's
table and plain reads; `gguf_prepare.py`: the folder of config, tokenizer and template
written from its metadata; `gguf_loader.py` and `models/packed.py`: each decoder
layer's matrices packed with their scales); structured output (`grammar_gate.py` on
the driver: a request waits out of the scheduler while its grammar compiles;
`grammar.py` on the rank: xgrammar compiles off the loop into a bounded cache, one
matcher per request, the token mask before sampling; `json_grammar.py`: a JSON schema
as EBNF with every number bounded); and the
offline `LLM` (`llm.py`).
"""
