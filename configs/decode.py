"""Configuration of `experiments/decode.py`: decode text with a target and a draft.

  python -m experiments.decode       # bundled pair, held-out test-split prompt
  python -m experiments.decode --config.scale=1b   # grown to a 1B shape (memory-bound)
  python -m experiments.decode --config.target=/path/to/hf_target \
      --config.draft=/path/to/hf_draft --config.prompt="def fibonacci(n):"

`target` and `draft` are local Hugging Face checkpoint directories (config.json,
safetensors, tokenizer.json) or hub repo ids ("org/name") found offline in the
local Hugging Face cache ($HF_HUB_CACHE); both empty (the default) means the pair bundled
in `specjax/pretrained`. They must share a tokenizer unless `drafter` is
cross_tokenizer or string_level:

  python -m experiments.decode --config.drafter=cross_tokenizer   # bundled cross draft
  python -m experiments.decode --config.target=/path/llama --config.draft=/path/gpt2 \
      --config.drafter=cross_tokenizer

A missing `target` or `draft` is one error naming the flag: a path (runs/target)
as a missing directory, a repo id as missing from the local cache (there is no
network download). The result's `draft` and `draft_params` describe the drafter
that decoded (a head's directory and parameters, the n-gram lookup, the
target's first layers), not the draft model when another drafter is used.

An empty `prompt` gives row i of the batch the i-th prompt of the held-out test
split (`specjax.data.prompts.held_out_prompts`), or with `constraint=signature`
(structured output; `prompt_set` chooses otherwise) a def to describe as JSON:

  python -m experiments.decode --config.constraint=signature
  python -m experiments.decode --config.constraint='regex:[0-9]{1,4}' --config.prompt="x = "

Confidence-driven verification length (costs measured here first, then reported):

  python -m experiments.decode --config.verify_lengths='(1,2,4)'

A prompt file decodes every prompt it holds and reports each category too
(`specjax/data/sample_prompts.jsonl` is in Spec-Bench's question.jsonl layout):

  python -m experiments.decode --config.prompt_file=specjax/data/sample_prompts.jsonl

`compare_transformers=True` also times transformers' `generate`, plain and with
`assistant_model=draft` (batch 1); it needs torch and transformers (see
experiments/make_hf_checkpoint.py).
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The decode configuration (no presets)."""
  config = ml_collections.ConfigDict()
  config.target = ""
  config.draft = ""
  # The bundled pair grown to a real model's shape, computing the same function
  # (specjax/pretrained/scales.py; docs/scaled_pairs.md): "" (as trained), 160m,
  # 1b (TinyLlama-shaped target, 68M-shaped draft) or 7b (for accelerators).
  config.scale = ""
  config.prompt = ""
  # Structured output (specjax.jobs.structured): "" (none) | signature (the bundled
  # task: a function's signature as JSON {"name": str, "args": [str]}) |
  # json:<schema file or inline JSON> | regex:<pattern> | choice:a|b|c. Both loops
  # decode under it, so the speedup is constrained against constrained; the result
  # adds the share of outputs that validate and the mask's cost per step.
  config.constraint = ""
  # The prompts when config.prompt is empty: "" (the constraint's task: the
  # signature prompts for constraint=signature, else held_out) | held_out | signature
  config.prompt_set = ""
  # A prompt file (specjax.data.prompts.read_prompt_file: .txt paragraphs, or .jsonl
  # rows with text / prompt / Spec-Bench's turns and an optional category): every
  # prompt is decoded, each category's in batches of batch_size rows (the last one
  # filled by repeating a prompt; only real rows count), all at one prompt width.
  # The result adds per_category (prompts, acceptance, tokens per iteration,
  # ms/token both ways, speedup); its overall figures are over every prompt (the
  # floor report, config.report_floor, is the first batch's).
  config.prompt_file = ""
  # Drafted tokens per iteration; 0 picks it from the batch size
  # (specjax.jobs.drafters.GAMMA_BY_BATCH: 4 at batch 1, 1 from batch 8 on) and the
  # drafter (its `preferred_gamma`: early exit drafts 1); a block drafter's at batch 1
  # is measured at start-up: the fastest of 1, 2, 4 and block_size - 1 against plain
  # decoding on this machine (specjax.bench.gamma_choice; the result's gamma_probe).
  config.gamma = 0
  # auto (greedy at T=0, else token) | token | block | greedy | coupled (Gumbel-max:
  # each row's text a function of its key, the same with every drafter)
  config.verifier = "auto"
  # model (the draft) | ngram | layer_skip (target's first layers) | eagle | medusa
  # | early_exit | dflash (draft heads on the target; the bundled ones, or config.head;
  # dflash: the block drafter)
  # | cross_tokenizer | string_level: a draft with a tokenizer of its own (the
  # bundled 1024-id cross draft, or config.draft's tokenizer.json), token-level
  # intersection in the jitted loop or string-level exact match around it
  config.drafter = "model"
  # a head's directory or cached repo id ("": the bundled head): a training run, an
  # exported head, or a hub layout (EAGLE-1/2, EAGLE-3, Medusa: specjax.hf.load_head)
  config.head = ""
  # FR-Spec for the bundled heads: draft among the K most frequent ids (0: all)
  config.vocab_subset = 0
  config.ngram = 3  # longest n-gram matched by the ngram drafter
  config.layer_skip = 2  # target layers the layer_skip drafter keeps
  config.adaptive = ""  # "" (fixed gamma) | schedule | confidence
  config.confidence_threshold = 0.5
  # Confidence-driven verification length (specjax.generation.verify_length): () off,
  # or the lengths to compile, e.g. '(2,4,7)' (gamma last; gamma 0 becomes the last).
  # Each iteration verifies the chains cut to the one the drafter's confidence makes
  # worth it by verify_costs: () measures them on this machine first (reported).
  config.verify_lengths = ()
  config.verify_costs = ()
  # Under config.constraint, draft the tokens the grammar forces first, at no drafter
  # cost (speculative_generate's forced_drafts; docs/usage.md "Drafts the grammar forces").
  config.forced_drafts = True
  # Both loops: "while" tests for finished rows after every iteration; "chunked"
  # after every loop_chunk iterations (on GPU, one device-to-host wait per chunk;
  # docs/performance.md). string_level runs its loop on the host: "while" only.
  config.loop = "while"
  config.loop_chunk = 8
  # Sample as the target checkpoint's generation_config.json says (do_sample,
  # temperature, top_k, top_p; transformers' defaults) instead of the three below.
  config.checkpoint_sampling = False
  config.temperature = 0.0
  config.top_k = 0
  config.top_p = 1.0
  # Warps that read each row's text (specjax.SamplingParams; docs/usage.md): any of
  # them on runs both loops with per-row settings and the rows' token counts.
  config.presence_penalty = 0.0
  config.frequency_penalty = 0.0
  config.repetition_penalty = 1.0
  config.min_p = 0.0
  config.max_new_tokens = 64
  config.batch_size = 1
  config.seed = 0
  config.dtype = "float32"  # float32 | bfloat16; float32 keeps greedy outputs comparable
  # The draft's (or draft head's) dtype when it differs: "" = dtype. A bfloat16
  # draft beside a float32 target reads half the bytes per draft call; the
  # output stays the target's (transformers' comparison runs both in dtype).
  config.draft_dtype = ""
  config.stop_at_eos = True  # timing runs with compare_transformers use a fixed length
  config.num_runs = 3
  # Also measure the machine's floor, the target's distance from it, the share of
  # an iteration that is neither model, compile times and a 512-token prefill.
  config.report_floor = True
  config.compare_transformers = False
  config.mesh_shape = (-1, 1)  # (data, model) over all devices; batch splits over data
  config.replicate_draft = True  # a full draft copy per device (no communication to draft)
  return config
