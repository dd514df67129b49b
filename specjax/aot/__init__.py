"""Compiling specjax's programs for accelerators this host does not have.

  JAX_PLATFORMS=cpu python -m experiments.accelerator_check --config.target=h100

`targets` (named GPUs and TPU topologies, their published figures), `shapes`
(the model shapes to compile), `place` (abstract models and batches on a
target's devices), `programs` (every program a user runs, lowered: `models`
builds what they take, `decode`, `serving` and `training` lower them), `analysis`
(a compiled program read: kernels, host work, memory, collectives), `fit` (the
largest batch that fits), `estimate` (a step-time estimate, labelled as one).
Imports point down: targets <- place <- models <- decode, serving, training <-
programs; analysis <- fit. The guide:
docs/accelerators.md.
"""
