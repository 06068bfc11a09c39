"""common: what every room shares. Pure Python, the leaf: it imports no other room.

- `request.py`: the request and its lifecycle (its statuses, phase times);
- `sampling_params.py`: sampling parameters, and the output constraints they carry
  (`structured_output.py`: JSON schema, regex, choice, grammar);
- `messages.py`: the wire messages between gateway and instances, and
  `block_events.py`: the block events among them;
- `wire_auth.py`: the deployment secret and the keys derived from it (frames, cache
  salts, a worker group's rendezvous); `frame_seal.py`: the seal every frame between
  processes carries (sender, channel, direction, sequence; size checked before
  hashing); `frame_drops.py`: what each channel dropped, and why;
- `model_split.py`: how a model splits across tensor- and pipeline-parallel ranks
  (`check_tp_size`, `check_pp_size`, `stage_layers`), and int8 weights' scale groups
  across them (`check_int8_groups`);
- `json_file.py`: a JSON file read with one-line errors (checkpoints, tokenizers);
- `named_values.py`: keyword arguments read by name off parsed flags or a config (a
  config built from the flags of the same names).
"""
