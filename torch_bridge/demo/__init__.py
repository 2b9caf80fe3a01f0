"""The torch demo: ``RopeManager`` through a serving trace, checked at every step.

Usage::

  make demo                      # creates .venv on first use, runs this and the JAX trace
  python -m torch_bridge.demo [--model {llama3.1,qwen2.5-yarn,phi3-longrope,deepseek-v2,
                                        qwen2-vl,qwen2.5-vl,qwen3-vl,glm-4.1v}]
                              [--steps N] [--device {auto,cpu,cuda}] [--seed S] [--speculative]

  --model   the real RoPE config (default llama3.1: Llama-3.1-8B's llama3 scaling;
            qwen2.5-yarn, phi3-longrope (Phi-3-mini-128k), deepseek-v2 (V2-Lite, YaRN,
            interleaved pairs)); the M-RoPE models run the multimodal trace of
            :mod:`~torch_bridge.demo.multimodal` (an image and a video, chunked
            prefill at explicit [3, n] positions, decode at counter + delta, a
            handoff that carries the delta)
  --steps   main-node steps, >= 7 (default 14); past the scripted trace a new request
            arrives every 4 steps, every other one a prefix-cache hit
  --device  auto (default): CUDA when torch and JAX both see a GPU, else CPU
  --seed    weights and token ids (default 0)
  --inject-fault  for tests: the prefix-cache probe claims one token too many (M-RoPE
            models: the decode node admits the handoff without its delta; with
            ``--speculative``: the rollback is published without its epoch), so the run
            must FAIL
  --speculative  the speculative-decoding trace instead (:mod:`~torch_bridge.demo.speculative_trace`:
            draft steps in a CUDA-graph bucket, verify with random acceptance, rollbacks, a
            handoff after a rollback); ``--steps`` counts its rounds (>= 5); 1-D models only

Two serving nodes share one tiny attention layer (random weights, 4 query heads,
2 KV heads, the model's real ``head_dim`` and RoPE config from
:data:`jaxrope.models.HF_CONFIGS`):

- the *main* node schedules up to 32 tokens a step: one decode token per running
  stream first, then chunks of the waiting prompts (chunked prefill). Its trace has
  requests of different lengths, batched decode, a prefix-cache hit (``r3`` shares
  35 prompt tokens with ``r0``; the cache serves its two full 16-token pages, then
  its prefill continues at position 32), a CFG branch (``r2``'s ``cfg`` stream is
  forked from ``main`` by a pre-fork in the KV plan, takes a 6-token negative
  prompt, and is packed with ``main`` under one plan label), requests finishing and
  new ones arriving;
- the *prefill* node prefills ``rD`` and publishes its counters; the main node
  ingests it, admits the publication, takes the KV over and continues decoding; a
  duplicate (stale) delivery of the same publication later must not rewind it;
- pure decode steps run as CUDA-graph-style replays: positions are planned into
  the static ``[8]`` buffer of a (bucket, slot) lease, q/k live in static ``[8, H, D]``
  buffers, and the entries past the live tokens must keep their old values.

Every step projects its tokens' q/k/v, lets the manager plan the positions and
rotate q and k in place, appends the rotated keys to each stream's KV cache, and
attends. The result is compared with a float64 numpy recompute of each stream's
whole sequence from scratch: raw projections of all its tokens, rotated at the
absolute positions the trace implies (token ``i`` of a stream sits at position
``i``; a forked stream shares its parent's first tokens), causal attention. A
wrong position anywhere (in q, in a cached key, after a fork, a prefix hit or a
handoff) shows up as an error. After each commit, every stream's counter must also
equal its KV length. The recompute uses the config's float64 serving
frequencies (``RopeConfig.serving_frequencies``); their agreement with HF's formulas
is what ``tests/test_frequencies.py`` checks, not this demo.

Output: one line per step and node (requests, tokens, range of the planned
positions, max abs error of the attention output, events), then a verdict line.
Exit status 0 when every check passes, 1 on any mismatch.

Modules: :mod:`~torch_bridge.demo.model` (the attention layer and its float64
recompute), :mod:`~torch_bridge.demo.node` (a serving node and the prefix cache),
:mod:`~torch_bridge.demo.trace` (the scripted trace),
:mod:`~torch_bridge.demo.multimodal` (the M-RoPE trace and its nodes),
:mod:`~torch_bridge.demo.speculative_trace` (the speculative trace),
:mod:`~torch_bridge.demo.cli` (arguments and the report). Prefill and decode as two
processes, the decode one killed and restarted: :mod:`~torch_bridge.demo.disagg` (the
nodes, the resume, the checks) and :mod:`~torch_bridge.demo.disagg_processes`
(``python -m torch_bridge.demo.disagg_processes``).

Example:
  >>> import contextlib, io
  >>> out = io.StringIO()
  >>> with contextlib.redirect_stdout(out):
  ...     status = main(["--steps", "7", "--device", "cpu"])
  >>> status, out.getvalue().splitlines()[-1].startswith("verdict: PASS")
  (0, True)
"""
from torch_bridge.demo.cli import main
from torch_bridge.demo.model import MODELS, TOLERANCE, VL_MODELS
from torch_bridge.demo.speculative_trace import MIN_ROUNDS
from torch_bridge.demo.trace import MIN_STEPS, TRACE

__all__ = ["MIN_ROUNDS", "MIN_STEPS", "MODELS", "TOLERANCE", "TRACE", "VL_MODELS", "main"]
