"""Sequence parallelism and a vocabulary-split LM head inside tensor-parallel replicas train
exactly as one process would.

Each case trains STEPS clipped AdamW steps on Gloo ranks (``train_case`` of the tensor-parallel
equivalence test) and compares, on every rank, the loss, the global gradient norm and every
gradient after every step (shards gathered whole), every parameter after the steps,
``evaluate``, the gathered logits and state dict, and gradients accumulated over two
iterations, with one process training the whole model on the same global batches. Cases: a
TP-2 stage with sequence parallelism (Qwen3, tied: its head stays whole); a TP-2 stage whose
head alone is split (LLaMA); a TP-2 stage with both (Qwen2: biased q/k/v projections); a
pipeline of two replicas of one rank into a TP-2 last stage with sequence parallelism and a
split head (LLaMA); two TP-2 replicas with sequence parallelism, a split head, ZeRO-1 and
activation checkpointing (Mistral); TP 4 with sequence parallelism and a head of 97 rows split
25/24/24/24 (LLaMA); the pipeline case under zero_bubble (its backward split into I and W) and
two TP-2 pipeline ranks interleaved, two chunks each, with sequence parallelism (LLaMA). One
sequence-parallel, split-head run is resumed from a portable checkpoint (every parameter
then bit for bit where the uninterrupted run's is) and exported whole (``from_pretrained``
gives back the gathered model bit for bit; the cases hold the gathered model to one process);
its loss and logits on sequences of 7 tokens, which TP 2 does not split evenly (the runtime
pads them to 8, masked), are the exported model's.
Tolerance: rtol 1e-5, atol 4e-5 in fp32, as the pipeline's other equivalence tests (the
reduce-scatters and the head's gather sum in another order than one process; no case needed
more).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.planner.plan import Plan
from tests.pipeline.test_runtime_equivalence import _compare, make_batches
from tests.pipeline.test_tensor_parallel_runtime import Case, tiny_config, train_case

pytestmark = pytest.mark.multiproc


@dataclass(frozen=True)
class SpCase(Case):
    sp: tuple[int, ...] = ()
    """Stages run sequence parallel."""
    sharded_optimizer: tuple[int, ...] = ()
    """Stages whose optimizer state is sharded among their replicas (ZeRO-1)."""
    schedule: str = ""
    """Another schedule than 1F1B (``zero_bubble``: each backward split into I and W)."""
    virtual: int = 1
    """Interleaved: chunks per pipeline rank (each stage cut into this many)."""

    def plan(self) -> Plan:
        p = super().plan()
        stages = tuple(replace(s, sequence_parallel=s.index in self.sp,
                               optimizer="sharded" if s.index in self.sharded_optimizer
                               else s.optimizer) for s in p.stages)
        p = replace(p, stages=stages)
        if self.virtual > 1:
            p = p.interleave(self.virtual)
        elif self.schedule:
            p = p.with_schedule(self.schedule)
        return p.validate(self.world)

    def projections(self, stage: int) -> int:
        """Qwen2's q, k and v biases are column-wise DTensors too."""
        return super().projections(stage) + (3 * self.blocks[stage] if self.family == "qwen2" else 0)

    def head_split(self, stage: int) -> bool:
        return stage == len(self.blocks) - 1 and self.tp[stage] > 1 and not self.tied


CASES = {
    2: [SpCase("tp2-sp-qwen3-tied", "qwen3", (2,), ((2,),), (2,), tied=True, sp=(0,)),
        SpCase("tp2-head", "llama", (2,), ((2,),), (2,)),
        SpCase("tp2-sp-head-qwen2", "qwen2", (1,), ((2,),), (2,), sp=(0,))],
    4: [SpCase("1x2|tp2-sp-head", "llama", (1, 1), ((1, 1), (2,)), (1, 2), sp=(1,)),
        SpCase("tp2x2-sp-head-zero-recompute", "mistral", (2,), ((1, 1),), (2,), sp=(0,),
               sharded_optimizer=(0,), recompute=(0,)),
        SpCase("tp4-sp-head", "llama", (1,), ((2,),), (4,), sp=(0,)),
        SpCase("1x2|tp2-sp-head-zero-bubble", "llama", (1, 1), ((1, 1), (2,)), (1, 2), sp=(1,),
               schedule="zero_bubble"),
        # rank 0 and 1 (one TP-2 replica) hold the embedding, block 0 and block 3; ranks 2 and 3
        # blocks 1 and 2, and the head alone
        SpCase("interleaved-tp2|tp2-sp-head", "llama", (2, 2), ((2,), (2,)), (2, 2), sp=(0, 1),
               virtual=2)],
}
RESUMED = SpCase("tp2-sp-head-resume", "llama", (2,), ((2,),), (2,), sp=(0,))


def _whole(rt) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in rt.stage.named_parameters()}


def resume_and_export(rank: int, root: str) -> dict:
    """Two steps, a portable checkpoint, a third step; a fresh runtime resumed from the
    checkpoint takes the third step too. Then the export, read back with from_pretrained."""
    from transformers import AutoModelForCausalLM

    from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
    from hapt_hf.pipeline.export import write_stage_shards
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    from hapt_hf.pipeline.portable import load_portable, save_portable
    case = RESUMED
    config = tiny_config(case.family, case.num_blocks)
    batches = make_batches(config.vocab_size, seed=5, rows=case.plan().global_batch_size)

    def start():
        rt = PipelineRuntime(case.plan(), config, RuntimeConfig(timeout_s=60, seed=7))
        return rt, rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    rt, opt = start()
    out: dict = {"errors": [], "head": rt.tp.head, "sp": rt.tp.sequence_parallel}
    for b in batches[:2]:
        rt.train_step(b, opt, max_grad_norm=0.5)
    save_portable(Path(root) / "ckpt", rt.stage, opt)
    rt.train_step(batches[2], opt, max_grad_norm=0.5)
    uninterrupted = _whole(rt)
    # a sequence the TP ranks cannot split evenly: padded to 8 inside, the logits cut back
    b = batches[0]
    short = replace(b, input_ids=b.input_ids[:, :7], labels=b.labels[:, :7],
                    attention_mask=b.attention_mask[:, :7])
    pred = rt.predict(short)
    write_stage_shards(rt, Path(root) / "export")
    state = rt.gather_state_dict()
    rt.shutdown()
    rt, opt = start()
    load_portable(Path(root) / "ckpt", rt.stage, opt)
    rt.train_step(batches[2], opt, max_grad_norm=0.5)
    for n, p in _whole(rt).items():
        if not torch.equal(p, uninterrupted[n]):
            out["errors"].append(f"resumed {n} differs by {(p - uninterrupted[n]).abs().max()}")
    rt.shutdown()
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(
            Path(root) / "export", attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
        with torch.no_grad():
            ref = model(short.input_ids, attention_mask=short.attention_mask, labels=short.labels)
        _compare("seq 7 loss", torch.tensor(pred.loss, dtype=torch.float64), ref.loss.double(),
                 out["errors"])
        _compare("seq 7 logits", pred.logits, ref.logits, out["errors"])
        exported = model.state_dict()
        if set(exported) != set(state):
            out["errors"].append(f"exported keys differ: {sorted(set(exported) ^ set(state))}")
        for k in set(exported) & set(state):
            if not torch.equal(exported[k], state[k]):
                out["errors"].append(f"exported {k} is not the gathered tensor")
    return out


def refusal(rank: int) -> str | None:
    """What a rank is told for a sequence-parallel stage of a model outside SP_MODEL_TYPES
    (StarCoder2: it has a tensor-parallel plan, but its blocks are not the pre-norm llama
    shape)."""
    from hapt_hf.pipeline import PipelineRuntime
    from hapt_hf.pipeline.runtime import RuntimeSetupError
    case = SpCase("tp2-sp-starcoder2", "starcoder2", (1,), ((2,),), (2,), sp=(0,))
    try:
        PipelineRuntime(case.plan(), tiny_config(case.family, 1)).shutdown()
    except RuntimeSetupError as e:
        return str(e)
    return None


def run_all(rank: int, world_size: int, root: str) -> dict:
    out = {c.name: train_case(rank, c) for c in CASES[world_size]}
    if world_size == 2:
        out["resume"] = resume_and_export(rank, root)
        out["refusal"] = refusal(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("sp"))
    return {w: [o.value for o in run_ranks(run_all, w, root, timeout_s=240)] for w in CASES}


ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{c.name}" for w, c in ALL])
def test_matches_single_process(results, world, case):
    plan = case.plan()
    for rank, per_rank in enumerate(results[world]):
        r = per_rank[case.name]
        assert not r["errors"], f"rank {rank} (stage {r['stage']}): " + "\n".join(r["errors"])
        assert max(r["norms"]) > 0.5, "clipping never engaged; the step check would be weaker"
        st = plan.stages[r["stage"]]
        assert r["tp"] == st.tp
        if case.virtual > 1:  # a rank's chunks: the counts below are per stage of a rank
            continue
        # the blocks' projections, and the head where it is split
        projections = case.projections(st.index) if st.tp > 1 else 0
        assert r["sharded"] == projections + case.head_split(st.index), r
        # summed over the replica: q_norm and k_norm (Qwen3), and under sequence parallelism
        # the two block norms
        partial = ({"qwen3": 2}.get(case.family, 0) + 2 * (st.index in case.sp)) \
            * case.blocks[st.index]
        assert r["partial"] == (partial if st.tp > 1 else 0), r


def test_resume_is_exact_and_the_export_is_the_gathered_model_and_predicts_an_odd_length(results):
    for rank, per_rank in enumerate(results[2]):
        r = per_rank["resume"]
        assert r["head"] and r["sp"], r
        assert not r["errors"], f"rank {rank}: " + "\n".join(r["errors"])


def test_a_model_outside_the_sequence_parallel_ones_is_refused_naming_it(results):
    for msg in (per_rank["refusal"] for per_rank in results[2]):
        assert msg is not None and msg.startswith("stage 0: "), msg
        assert "'starcoder2' is not among the models whose blocks run sequence parallel" in msg
        assert 'set the stage\'s "sp" to false' in msg, msg
