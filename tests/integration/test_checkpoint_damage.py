"""A damaged file in the checkpoint a run resumes from: one message naming it, every rank exits
non-zero, and the output directory is left exactly as it was (nothing written before the check).

The recipe's main() runs on 2 Gloo ranks through run_ranks (as `accelerate launch` would start
it, without paying the imports twice); the checkpoint comes from a 2-step run of the same recipe.
"""
from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "finetune_gpt2.py"
SEQ = 32


def recipe_rank(rank: int, world_size: int, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("finetune_gpt2", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(module.DEFAULTS, argv)


def _run(hapt: Path, out: Path, *extra: str):
    argv = ["--hapt_config", str(hapt), "--output_dir", str(out), "--seq_len", str(SEQ),
            "--disable_tqdm", *extra]
    return run_ranks(recipe_rank, 2, argv, init_process_group=False, timeout_s=240, check=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(hapt config, output directory with checkpoint-1 and checkpoint-2) of a 2-step run."""
    tmp = tmp_path_factory.mktemp("trained")
    Plan(model_name="gpt2-tiny", num_layers=8, seq_len=SEQ, global_batch_size=4,
         micro_batch_size=1, num_microbatches=4, schedule="1f1b",
         stages=(Stage.even(0, (0, 4), "a", "cpu", (0,), 2, micro_batch_size=1),
                 Stage.even(1, (4, 8), "b", "cpu", (1,), 1, micro_batch_size=1))
         ).save(tmp / "plan.json")
    hapt = tmp / "hapt.yaml"
    hapt.write_text(f"plan: plan.json\nschedule: 1f1b\nglobal_batch_size: 4\nseq_len: {SEQ}\n"
                    "timeout_s: 30\n")
    out = tmp / "out"
    outs = _run(hapt, out, "--max_steps", "2", "--save_steps", "1")
    assert [o.value for o in outs] == [0, 0], [(o.error, o.stderr_tail) for o in outs]
    assert (out / "checkpoint-2" / "hapt_rank1.pt").is_file()
    return hapt, out


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: size, modification time and content hash."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"{not a checkpoint" * 4)


@pytest.mark.parametrize("name, how", [("model-00002-of-00002.safetensors", "truncate"),
                                       ("hapt_rank1.pt", "garbage"),
                                       ("trainer_state.json", "garbage")])
def test_damaged_checkpoint_file_is_named_once_and_nothing_is_written(trained, tmp_path, name,
                                                                      how):
    hapt, trained_out = trained
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    damaged = out / "checkpoint-2" / name
    _damage(damaged, how)
    before = _snapshot(out)
    outs = _run(hapt, out, "--max_steps", "3", "--resume_from_checkpoint", "last")
    stderr = "\n".join(o.stderr_tail for o in outs)
    assert all(o.ok and o.value == 2 for o in outs), [(o.value, o.error) for o in outs] + [stderr]
    errors = [l for l in stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert str(damaged) in errors[0] and "damaged" in errors[0], errors[0]
    assert "resume_from_checkpoint" in errors[0], errors[0]
    assert _snapshot(out) == before, "a refused resume must leave the output directory as it was"
