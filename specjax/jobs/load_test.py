"""The load test's job (`experiments/load_test.py`): held-out prompts at Poisson
arrival rates, per mode, in process or against a running server; the report
(JSON, markdown table, sweep figure).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from specjax.bench.serving import load, load_report
from specjax.jobs.serve import engine_config, load_models, load_tokenizer
from specjax.sampling import SamplingParams
from specjax.validation import check_int, check_positive_int, is_real

JSON_FILE, TABLE_FILE, FIGURE_FILE = "load_test.json", "load_test.md", "load_sweep.png"
_MODEL_FIELDS = ("config.model", "config.hf_target", "config.hf_draft")


def _sampling(config: ml_collections.ConfigDict) -> SamplingParams:
  try:
    return SamplingParams(config.temperature, config.top_k, config.top_p)
  except ValueError as e:  # its messages start with the field's name
    raise ValueError(f"config.{e}") from None


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a ValueError naming the field for a bad setting, before any work."""
  rates = tuple(config.rates)
  if not rates:
    raise ValueError("config.rates must hold at least one rate (requests/s).")
  for rate in rates:
    load.check_rate("config.rates", rate)
  modes = tuple(config.modes)
  if not modes or len(set(modes)) != len(modes) or not set(modes) <= set(load.MODES):
    raise ValueError(
      f"config.modes must be distinct names among {', '.join(load.MODES)}, got {modes!r}."
    )
  check_positive_int("config.num_requests", config.num_requests)
  check_positive_int("config.repeats", config.repeats)
  check_positive_int("config.max_new_tokens", config.max_new_tokens)
  check_int("config.seed", config.seed)
  for name in ("slo_ttft_s", "slo_tpot_s"):
    value = config[name]
    if not is_real(value) or not value >= 0:
      raise ValueError(f"config.{name} must be a number >= 0 (0: no objective), got {value!r}.")
  if config.target != "inprocess" and not config.target.startswith(("http://", "https://")):
    raise ValueError(
      f"config.target must be 'inprocess' or a server URL (http://host:port), "
      f"got {config.target!r}."
    )
  _sampling(config)
  if config.drafter != "model":
    from specjax.jobs import drafters

    drafters.check_drafter_name(config.drafter, allowed=("model", *drafters.head_drafters()))
    if config.model != "bundled" or config.target != "inprocess":
      raise ValueError(
        f"config.drafter={config.drafter!r} drafts with the bundled head: it needs "
        f"config.model='bundled' and config.target='inprocess', got {config.model!r} and "
        f"{config.target!r}."
      )
  try:
    engine_config(config, "adaptive", fit_model=False)
  except ValueError as e:  # EngineConfig's messages start with the field's name
    raise ValueError(f"config.{e}") from None


SOAK_JSON, SOAK_TABLE = "soak.json", "soak.md"


def soak(config: ml_collections.ConfigDict, output_dir: str, progress=print) -> dict[str, Any]:
  """The soak under hostility (`specjax.bench.serving.soak`) against `config.target`: a
  calm run, then the hostile mix, each `config.soak_s` seconds at the first rate;
  writes DIR/soak.json and DIR/soak.md (the table, also printed)."""
  from specjax.bench.serving import soak as soaking
  from specjax.jobs.serve import API_KEY_ENV

  if not config.target.startswith(("http://", "https://")):
    raise ValueError(f"config.soak_s needs a server URL as config.target, got {config.target!r}.")
  if not is_real(config.soak_hostile) or not config.soak_hostile > 0:
    raise ValueError(
      f"config.soak_hostile must be > 0 (hostile requests/s), got {config.soak_hostile!r}."
    )
  check_int("config.server_pid", config.server_pid, 0)
  # Cut to the server's prompt limit in characters (at least one each, in code).
  limit = int(load.http_server_info(config.target)["max_prompt_len"])
  prompts = [p[-limit:] for p in load.held_out_texts(config.num_requests)]
  key = config.api_key or os.environ.get(API_KEY_ENV) or None
  runs = {}
  for name, hostile in (("calm", 0.0), ("hostile", float(config.soak_hostile))):
    progress(f"soak: {name} run, {config.soak_s:g} s at {config.rates[0]:g} requests/s")
    runs[name] = soaking.soak(
      config.target,
      prompts,
      duration_s=float(config.soak_s),
      rate=float(config.rates[0]),
      hostile=hostile,
      max_new_tokens=config.max_new_tokens,
      seed=config.seed,
      pid=config.server_pid or None,
      api_key=key,
    )
  result = {"config": config.to_dict(), "runs": runs, "environment": _environment()}
  with open(os.path.join(output_dir, SOAK_JSON), "w") as f:
    json.dump(result, f, indent=2)
  table = soaking.soak_table(runs["calm"], runs["hostile"])
  with open(os.path.join(output_dir, SOAK_TABLE), "w") as f:
    f.write(table + "\n")
  progress(table)
  return result


def _in_process_engines(config, progress):
  """`(tokenizer, {mode: warmed-up engine}, {mode: warm-up seconds})`. Every
  mode's engine stays alive: the modes take turns within each round
  (`load.sweep`)."""
  from specjax.serving import Engine

  need_draft = any(mode != "plain" for mode in config.modes)
  target, draft, tokenizer, eos, _ = load_models(
    config.model,
    config.hf_target,
    config.hf_draft,
    dtype=config.dtype,
    stop_at_eos=config.stop_at_eos,
    seed=config.seed,
    need_draft=need_draft,
    fields=_MODEL_FIELDS,
  )
  if need_draft and config.drafter != "model":  # a bundled head drafts for the bundled target
    from specjax.jobs.drafters import build_drafter

    draft = build_drafter(config.drafter, target, flag="config")
  engines, warmup_s = {}, {}
  for mode in config.modes:
    policy = load.MODES[mode]
    settings = engine_config(config, policy, fit_model=False)
    engine = Engine(target, None if policy == "never" else draft, settings, eos_ids=eos)
    start = time.perf_counter()
    engine.warmup(progress=lambda line, mode=mode: progress(f"{mode}: {line}"))
    warmup_s[mode] = time.perf_counter() - start
    progress(f"{mode}: engine warmed up in {warmup_s[mode]:.1f} s")
    engines[mode] = engine
  return tokenizer, engines, warmup_s


def run(
  config: ml_collections.ConfigDict,
  output_dir: str,
  progress: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Runs the load test `config` describes; writes and returns the report."""
  check_config(config)
  os.makedirs(output_dir, exist_ok=True)
  if config.get("soak_s", 0):
    return soak(config, output_dir, progress)
  rates = [float(r) for r in config.rates]
  slos = dict(slo_ttft_s=config.slo_ttft_s or None, slo_tpot_s=config.slo_tpot_s or None)
  result: dict[str, Any] = {"config": config.to_dict(), "target": config.target, "warmup_s": {}}
  if config.target == "inprocess":
    tokenizer, engines, result["warmup_s"] = _in_process_engines(config, progress)
    requests = _requests(
      config, tokenizer, engine_config(config, "adaptive", fit_model=False).max_prompt_len
    )
    rows = load.sweep(
      engines, requests, rates, seed=config.seed, repeats=config.repeats, progress=progress, **slos
    )
    del engines
  else:
    server = load.http_server_info(config.target)
    mode = load.POLICY_MODES.get(server.get("policy"), server.get("policy"))
    if mode not in config.modes:
      raise ValueError(
        f"config.modes must include the server's mode {mode!r} (its policy "
        f"{server.get('policy')!r}); got {tuple(config.modes)!r}."
      )
    progress(f"server {config.target}: {server}")
    tokenizer = load_tokenizer(config.model, config.hf_target, _MODEL_FIELDS)
    requests = _requests(config, tokenizer, int(server["max_prompt_len"]))
    rows = load.sweep(
      {mode: config.target},
      requests,
      rates,
      seed=config.seed,
      repeats=config.repeats,
      progress=progress,
      **slos,
    )
    result["server"] = server
    result["server_metrics"] = load.http_metrics(config.target)
  result["runs"] = rows
  result["adaptive_vs_best"] = load_report.compare_modes(rows)
  result["environment"] = _environment()
  with open(os.path.join(output_dir, JSON_FILE), "w") as f:
    json.dump(result, f, indent=2)
  progress(f"wrote {os.path.join(output_dir, JSON_FILE)}")
  render(result, output_dir, progress)
  return result


def render(
  result: dict[str, Any], output_dir: str, progress: Callable[[str], None] = print
) -> None:
  """The report's table (DIR/load_test.md, and printed) and, for a sweep, its figure."""
  table = load_report.sweep_table(result["runs"])
  with open(os.path.join(output_dir, TABLE_FILE), "w") as f:
    f.write(table + "\n")
  progress(table)
  if len({r["rate"] for r in result["runs"]}) > 1:
    figure = load_report.plot_sweep(result["runs"], os.path.join(output_dir, FIGURE_FILE))
    progress(f"wrote {figure}")


def _requests(config, tokenizer, max_prompt_len: int):
  return load.held_out_requests(
    config.num_requests,
    tokenizer,
    max_new_tokens=config.max_new_tokens,
    max_prompt_len=max_prompt_len,
    sampling=_sampling(config),
    seeded=config.seeded,
  )


def _environment() -> dict[str, Any]:
  from specjax import bench

  return bench.environment_info()
