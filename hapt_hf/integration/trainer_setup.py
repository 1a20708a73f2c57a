"""From what ``Trainer`` is given to what a pipeline runs: the plan and this rank's stage.

``HaptTrainer(model=..., args=...)`` takes the user's whole model, as ``Trainer`` does. Here the
process group is joined (or the launcher's used), rank 0 plans for the global batch the
arguments define (``per_device_train_batch_size x gradient_accumulation_steps x processes``, the
data-parallel meaning ``Trainer`` gives them) and broadcasts the plan, and this rank's stage is
built and given the model's weights: copied from a model in memory, or read, for this stage only,
from the checkpoint directory of a model left on the meta device. Nothing here draws from the
user's random number generators.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hapt_hf.errors import ConfigError, TrainingArgsError
from hapt_hf.integration import elastic
from hapt_hf.integration.config import HAPT_CONFIG_ENV, HaptConfig
from hapt_hf.integration.lora import apply_lora_config, check_lora_plan, peft_parts
from hapt_hf.integration.launch import LaunchEnv, init_process_group, read_launch_env
from hapt_hf.integration.plan_resolution import check_model_family, format_plan, resolve_plan
from hapt_hf.pipeline import checkpoint_io
from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
from hapt_hf.planner.plan import Plan

__all__ = ["hapt_config_of", "local_config", "global_batch_of", "seq_len_of", "pipeline_for_model",
           "stage_runtime"]


def hapt_config_of(given: HaptConfig | str | os.PathLike | None) -> HaptConfig:
    """The hapt config: a :class:`HaptConfig`, a path to one, ``$HAPT_CONFIG``, or else
    :func:`local_config` (the launched processes planned as alike devices)."""
    if isinstance(given, HaptConfig):
        return given
    if given is None and not os.environ.get(HAPT_CONFIG_ENV):
        return local_config(read_launch_env())
    return HaptConfig.from_args_or_env(None if given is None else str(given))


# A CPU's speed, where no cluster file says it: it sets the predicted times, and with every
# process alike the layers are still shared evenly by speed.
NOMINAL_CPU_TFLOPS = 0.1


def local_config(launch: LaunchEnv) -> HaptConfig:
    """With no hapt config: the launched processes as ONE group of alike devices (this node's
    GPU type, or CPUs), ``LOCAL_WORLD_SIZE`` per node. Unlike devices need a cluster file."""
    from hapt_hf.planner.catalogue import find_gpu
    from hapt_hf.planner.cluster import Cluster

    world = launch.world_size
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nodes, per_node = (world // per_node, per_node) if world % per_node == 0 else (1, world)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(launch.local_rank % torch.cuda.device_count())
        if find_gpu(name) is None:
            raise ConfigError(f"no hapt config given and this node's GPU {name!r} is not in the "
                              "GPU catalogue; give hapt_config= (a cluster file with its tflops "
                              "and memory_gb, docs/cluster-file.md) or set HAPT_CONFIG")
        gpu: dict[str, Any] = {"gpu": name}
    else:
        ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        gpu = {"gpu": "cpu", "tflops": NOMINAL_CPU_TFLOPS, "memory_gb": ram_gb / per_node}
    cluster = Cluster.from_dict({"name": "local", "groups": [
        {"name": "local", **gpu, "nodes": nodes, "gpus_per_node": per_node}]})
    return HaptConfig(cluster=cluster, source="<no hapt config: the launched processes as "
                                              "alike devices>")


def global_batch_of(args: Any, world_size: int) -> tuple[int, str]:
    """Samples per optimizer step as ``Trainer`` defines them, and how (for messages)."""
    per, acc = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return per * acc * world_size, (f"per_device_train_batch_size x gradient_accumulation_steps"
                                    f" x processes = {per} x {acc} x {world_size}")


def seq_len_of(config: HaptConfig, *datasets: Any) -> int:
    """The plan's tokens per sample: the hapt config's ``seq_len``, else the length of the
    first row of the first dataset given (drawing no random numbers)."""
    if config.seq_len is not None:
        return config.seq_len
    for data in datasets:
        if data is None:
            continue
        try:
            first = data[0] if not isinstance(data, torch.Tensor) else {"input_ids": data[0]}
            return len(first["input_ids"])
        except (TypeError, KeyError, IndexError, NotImplementedError):
            pass
        if type(data).__name__ == "IterableDataset" and hasattr(data, "take"):
            try:  # a datasets.IterableDataset: its first example, read without a shuffle
                return len(next(iter(data.take(1)))["input_ids"])
            except (StopIteration, KeyError, TypeError):
                continue
    raise ConfigError(f"{config.source}: cannot read the sequence length from the datasets (rows "
                      "without 'input_ids', or an iterable dataset that is not a "
                      "datasets.IterableDataset); set seq_len in the hapt config")


def _requested_precision(config: HaptConfig, args: Any) -> HaptConfig:
    """``TrainingArguments(bf16=True)`` / ``fp16=True`` ask for that precision where the hapt
    config leaves it to the cluster; where the config names another, the trainer's check
    refuses the pair (integration/trainer_checks.py)."""
    wanted = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) \
        else None
    if wanted is None or config.plan is not None or config.requested_precision not in (None, "auto"):
        return config
    return replace(config, precision=wanted, dtype=None)


def pipeline_for_model(model: nn.Module, args: Any, config: HaptConfig, seq_len: int
                       ) -> PipelineRuntime:
    """Join the job, agree on the plan and build this rank's stage with ``model``'s weights
    (the plan is ``runtime.plan``)."""
    launch = read_launch_env()
    init_process_group(launch, config.timeout_s)
    model_config = getattr(model, "config", None)
    if model_config is None:
        raise ConfigError(f"HaptTrainer(model=...) got a {type(model).__name__} without a "
                          "transformers config; give a transformers causal LM (from_pretrained "
                          "or from_config)")
    check_model_family(model_config)
    asked = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    target = elastic.run_global_batch(config.global_batch_size, args.output_dir)
    if target is not None:  # an elastic run keeps its global batch on any world
        elastic.keep_global_batch(args, target, launch.world_size)
    batch, how = global_batch_of(args, launch.world_size)
    config = _requested_precision(config.with_global_batch(batch, how), args)
    with torch.random.fork_rng(devices=[]):  # planning draws nothing from the user's RNG
        plan = resolve_plan(config, model_config, seq_len, launch)
    if target is not None or elastic.restartable():
        # the agent's restart counts may differ between nodes: rank 0's global batch rules
        elastic.keep_global_batch(args, plan.global_batch_size, launch.world_size)
        batch, how = global_batch_of(args, launch.world_size)
        now = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
        if now != asked and launch.is_main:
            print(f"hapt_hf: per_device_train_batch_size {asked[0]} -> {now[0]}, "
                  f"gradient_accumulation_steps {asked[1]} -> {now[1]} keep the run's global "
                  f"batch of {batch} samples on {launch.world_size} processes", flush=True)
    if plan.global_batch_size != batch:
        raise TrainingArgsError(f"the plan {str(config.plan)!r} runs global batches of "
                                f"{plan.global_batch_size} samples but {how} = {batch}; set "
                                "the batch arguments to match or re-plan")
    if launch.is_main:
        print(format_plan(plan), flush=True)
    runtime = stage_runtime(model, plan, config.timeout_s, args.seed)
    return runtime


def stage_runtime(model: nn.Module, plan: Plan, timeout_s: float, seed: int = 0,
                  error: type[ConfigError] = ConfigError) -> PipelineRuntime:
    """This rank's runtime for ``plan``, its stage holding ``model``'s weights: copied from a
    model in memory (a LoRA PEFT model: its adapters too, and its trainable flags), or read for
    this stage only from the checkpoint directory of a model on the meta device. The caller's
    RNG is left as it was. ``error``: the class a refusal is raised as (the caller's own)."""
    lora, model = peft_parts(model)
    if lora is not None:
        check_lora_plan(plan)
    on_meta = any(p.is_meta for p in model.parameters())
    source = str(getattr(model.config, "name_or_path", "") or "")
    if on_meta and not list(Path(source or "/nonexistent").glob("*.safetensors")):
        raise error(f"the model is on the meta device and its config's name_or_path {source!r} "
                    "is no directory with safetensors weights; build it from a local "
                    "checkpoint's config, or give the model in memory")
    with torch.random.fork_rng(devices=[]):  # the user's RNG stays as one process has it
        # every weight of the stage is read or copied next: no seeded initialisation to overwrite
        runtime = PipelineRuntime(plan, model.config, RuntimeConfig(
            timeout_s=timeout_s, seed=seed, init_weights=False,
            checkpoint_dir=source if on_meta else None))
    if lora is not None:  # a PEFT model: the same adapters on this stage's modules
        apply_lora_config(runtime.stage, lora)
        trainable = {n: p.requires_grad for n, p in model.named_parameters()}
        for name, p in runtime.stage.named_parameters():
            p.requires_grad = trainable.get(name, False)
    if not on_meta:  # the user's own weights, however they were made
        full = model.state_dict()
        for key, target in runtime.stage.state_dict(keep_vars=True).items():
            if key not in full:
                raise error(f"the model has no tensor {key!r} that its stage holds; give a "
                            "transformers causal LM (or a LoRA PEFT model of one)")
            checkpoint_io.copy_into(target, full[key], key)
    return runtime
