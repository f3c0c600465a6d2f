"""The documentation: generated parts fresh, the config reference complete, the README short, and
the how-to commands dry-run as a user would type them.

Freshness: `qatlib.site.generate(write=False)` renders every generated block (config keys from the
schema, formats x runtimes from `qatlib.runtime.facts`, results from results/bench/*.json) and
names the ones that differ from the files: a schema key, a runtime fact or a JSON changed without
`python -m qatlib.site` fails here.

How-to commands: each docs page holds its commands between ``<!-- dry-run: NAME -->`` and
``<!-- /dry-run -->``. The test reads them from the page (so the page and the test cannot drift)
and runs them from the repository root with HOME set to a temporary folder: a YAML block whose
first line is ``# ~/PATH...`` is written to that path, and the absolute ``/data/...`` files the
YAML names are created empty under the temporary folder (the same path with ``/data`` moved
there); ``~/AngelSlim`` is the byte-identical copy of AngelSlim's configs in tests/data/upstream/. Each ``snakemake`` command runs as a dry run (``-n -p``, its own ``--directory``); the
others run as written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from qatlib.site import REPO, blocks, config_reference, generate, targets

DOCS = REPO / "docs"
DRY_RUN = re.compile(r"<!-- dry-run: ([\w-]+) -->\n(.*?)<!-- /dry-run -->", re.S)
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
USER_DATA = re.compile(r"(?<![\w.~/-])/data/")  # a user's data file in the docs: /data/...
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# the docs pages other tools write (their own tests keep them): not checked for hand-typed figures
OTHER_OWNERS = {"design.md", "runtime-oracle.md", "upstream-compat.md"}


# ----------------------------------------------------------------------------- generated blocks
def test_generated_blocks_are_fresh():
    stale = generate(REPO, write=False)
    assert not stale, "stale generated blocks (run: python -m qatlib.site): " + ", ".join(
        f"{t.path}:{t.block}" for t in stale
    )


def test_blocks_replace_only_between_their_markers():
    text = f"before\n{blocks.open_marker('t')}\nold\n{blocks.close_marker('t')}\nafter\n"
    new = blocks.replace(text, "t", "new\nlines")
    assert new == f"before\n{blocks.open_marker('t')}\nnew\nlines\n{blocks.close_marker('t')}\nafter\n"
    assert blocks.body(new, "t") == "new\nlines"
    with pytest.raises(blocks.BlockError, match="no generated block 'u'"):
        blocks.replace(text, "u", "x", where="page.md")
    with pytest.raises(blocks.BlockError, match="2 generated block 't'"):
        blocks.body(text + text, "t")


def test_every_generated_block_exists_once():
    for t in targets():
        text = (REPO / t.path).read_text()
        assert blocks.names(text).count(t.block) == 1, (t.path, t.block)


def test_config_reference_names_exactly_the_schema_keys():
    from qatlib.config import config_json_schema

    schema = config_json_schema()
    page = (DOCS / "reference/config.md").read_text()
    named = config_reference.page_keys(blocks.body(page, "config-keys"))
    keys = config_reference.schema_keys(schema)
    assert sorted(set(keys) - set(named)) == [], "schema keys missing from docs/reference/config.md"
    assert sorted(set(named) - set(keys)) == [], "docs/reference/config.md names keys the schema lacks"
    assert named == keys  # once each, in schema order


def test_config_reference_refuses_a_key_without_a_meaning():
    from qatlib.config import config_json_schema

    schema = config_json_schema()
    schema["$defs"]["GlobalConfig"]["properties"]["new_key"] = {"type": "integer", "default": 1}
    with pytest.raises(KeyError, match="no meaning for global.new_key"):
        config_reference.rows(schema)
    del schema["$defs"]["GlobalConfig"]["properties"]["seed"]
    with pytest.raises(KeyError, match="keys the schema lacks: global.seed"):
        config_reference.rows(schema)


def test_keys_in_upstream_yaml_files_are_marked_upstream():
    """A key AngelSlim's own configs set is upstream's, never qatlib's."""
    seen: set[str] = set()

    def walk(d, prefix=""):
        if isinstance(d, dict):
            for k, v in d.items():
                seen.add(f"{prefix}{k}")
                if k != "hf_args":
                    walk(v, f"{prefix}{k}.")

    for f in (REPO / "tests/data/upstream/configs").rglob("*.yaml"):
        walk(yaml.safe_load(f.read_text()))
    assert seen and not (seen & config_reference.QATLIB_KEYS)


def test_results_figures_come_from_the_json():
    """The results page shows the committed JSON's own numbers (one spot check per file)."""
    page = (DOCS / "results.md").read_text()
    bench = REPO / "results/bench"
    default = bench / "default_experiment.json"
    if default.is_file():
        met = json.loads(default.read_text())["metrics"]
        key = next(k for k in sorted(met) if k.startswith("ppl/") and k.endswith("/qat"))
        assert f"{met[key]:.3f}" in page
    rehearsal = bench / "plan_rehearsal.json"
    if rehearsal.is_file():
        st = json.loads(rehearsal.read_text())["stages"]["ptq_calibrate"]
        assert f"{st['measured_over_predicted'][0]:.2f}" in page
        assert f"{st['peak_rss_per_rank'][0] / 2**30:.2f} GiB" in page
    fp4 = bench / "quality_fp4.json"
    if fp4.is_file():
        for row in json.loads(fp4.read_text())["formats"]:
            assert f"| {row['qat_ppl']:.3f} | {row['recovery_vs_rtn']:.3f} |" in page, row["format"]
    for rows in (
        bench / "quality_low_bits.json",
        bench / "quality_w4a4.json",
        bench / "quality_w4a4_two_phase.json",
    ):
        if not rows.is_file():
            continue
        for f in json.loads(rows.read_text())["formats"]:
            for row in f["rows"]:
                cell = f"| {row['ppl']:.3f} | {row['recovery']:.3f} ± {row['recovery_se']:.3f} |"
                if "loss_recovery" in row:  # the test-loss recovery beside (benchmarks.quality_low_bits)
                    cell += f" {row['loss_recovery']:.3f} ± {row['loss_recovery_se']:.3f} |"
                assert cell in page, (rows.name, f["format"], row["variant"])
    for moe in (bench / "moe_experiment.json", bench / "nvfp4_two_phase_experiment.json"):
        if not moe.is_file():
            continue
        for e in json.loads(moe.read_text())["experiments"]:
            assert (
                " | ".join(f"{e['ppl'][v]:.3f}" for v in ("bf16", "ptq", "qat", "export", "deployed")) in page
            )
            dep = next(r for r in e["rows"] if r["variant"] == "deployed")
            assert f"| deployed | {dep['recovery']:.3f} | {dep['recovery_se']:.3f} |" in page, e["experiment"]


def _outside_blocks(text: str) -> str:
    return re.sub(r"<!-- generated:.*?<!-- /generated:[\w.-]+ -->", "", text, flags=re.S)


def test_no_dated_measurements_outside_generated_blocks():
    """Measurements live in the JSON and its generated tables, never in hand-written prose."""
    pages = [REPO / "README.md", REPO / "benchmarks/README.md"]
    pages += [p for p in DOCS.rglob("*.md") if p.name not in OTHER_OWNERS]
    for p in pages:
        found = DATE.findall(_outside_blocks(p.read_text()))
        assert not found, f"{p.relative_to(REPO)}: dated text {found}"


# ----------------------------------------------------------------------------- README and site
def test_readme_is_one_short_page_with_the_two_commands_first():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    first_screen = "\n".join(lines[:30])
    assert "bash install.sh && snakemake" in first_screen
    assert "bash install.sh && python3 -m pytest" in first_screen


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages == listed, (sorted(pages - listed), sorted(listed - pages))


def test_docs_link_only_to_files_that_exist():
    for p in [REPO / "README.md", *DOCS.rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", p.read_text()):
            if "://" in target:
                continue
            assert (p.parent / target).exists(), f"{p.relative_to(REPO)} links to missing {target}"


# ----------------------------------------------------------------------------- how-to dry runs
def how_to(page: str, name: str) -> list[tuple[str, str]]:
    """The fenced blocks ``(language, text)`` between the page's dry-run markers ``name``."""
    found = {m[1]: m[2] for m in DRY_RUN.finditer((DOCS / page).read_text())}
    assert name in found, f"docs/{page}: no <!-- dry-run: {name} --> block"
    return [(lang, text) for lang, text in FENCE.findall(found[name])]


def run_how_to(page: str, name: str, home: Path) -> list[tuple[str, str]]:
    """Write the page's YAML blocks and run its commands; ``(command, output)`` of each."""
    home.mkdir(parents=True)
    (home / "AngelSlim").symlink_to(REPO / "tests/data/upstream")  # a clone of AngelSlim (its configs/)
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    ran = []
    for lang, text in how_to(page, name):
        text = USER_DATA.sub(f"{home}/data/", text)
        if lang == "yaml":
            first = text.splitlines()[0]
            m = re.match(r"#\s*~/(\S+?):?\s", first + " ")
            assert m, f"docs/{page}: a YAML block starts with '# ~/PATH': {first!r}"
            path = home / m[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            for data in re.findall(rf"{re.escape(str(home))}/data/[^\s,}}\]'\"]+", text):
                Path(data).parent.mkdir(parents=True, exist_ok=True)
                Path(data).touch()
            continue
        assert lang == "bash", lang
        for cmd in (c for c in text.splitlines() if c.strip() and not c.lstrip().startswith("#")):
            full = cmd
            if cmd.startswith("snakemake "):
                full += f" --directory {home}/wd -n -p"
            res = subprocess.run(
                ["bash", "-c", full], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
            )
            out = res.stdout + res.stderr
            assert res.returncode == 0, f"docs/{page}: `{cmd}` failed ({res.returncode}):\n{out[-4000:]}"
            ran.append((cmd, out))
    return ran


HOW_TOS = {
    "own-model": ("how-to/own-model.md", "own-model"),
    "upstream-config": ("how-to/upstream-config.md", "upstream-config"),
    "slurm-2x8": ("how-to/slurm.md", "slurm-2x8"),
}


@pytest.fixture(scope="module")
def how_to_runs(tmp_path_factory):
    """All three pages' commands, the pages side by side (each mostly waits on imports)."""
    pytest.importorskip("snakemake")
    root = tmp_path_factory.mktemp("how-to")
    todo = dict(HOW_TOS)
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:  # the slurm extra
        todo.pop("slurm-2x8")
    with ThreadPoolExecutor(len(todo)) as pool:
        futures = {k: pool.submit(run_how_to, page, name, root / k) for k, (page, name) in todo.items()}
        return {k: f.exception() or f.result() for k, f in futures.items()}


def ran(how_to_runs, name: str) -> list[tuple[str, str]]:
    """The page's ``(command, output)`` list; its own failure is raised here, in its own test."""
    if name not in how_to_runs:
        pytest.skip("snakemake-executor-plugin-slurm not installed (pip install -e '.[slurm]')")
    got = how_to_runs[name]
    if isinstance(got, BaseException):
        raise got
    return got


def _snakemake_out(ran: list[tuple[str, str]]) -> str:
    return next(out for cmd, out in ran if cmd.startswith("snakemake "))


def _qat_shell(out: str) -> str:
    return next(line for line in out.splitlines() if "scripts/qat.py -c" in line)


FULL_DAG = {
    "ptq_calibrate": 1,
    "zero3_qat": 1,
    "convert_export": 1,
    "export_ptq": 1,
    "evaluate": 5,
    "serve_evaluate": 2,
    "sqnr": 1,
    "report": 1,
}


def _jobs(out: str) -> dict[str, int]:
    m = re.search(r"Job stats:\n.*?\n-+\s+-+\n(.*?)\ntotal\s+\d+", out, re.S)
    assert m, out[-3000:]
    return {rule: int(n) for rule, n in (line.split() for line in m[1].splitlines())}


def test_how_to_own_hub_model_on_one_8_gpu_node(how_to_runs):
    outs = ran(how_to_runs, "own-model")
    check = next(out for cmd, out in outs if cmd.startswith("python -m qatlib.config"))
    assert '"quant_scheme"' in check and '"zero3": true' in check
    plan = next(out for cmd, out in outs if cmd.startswith("python -m qatlib.plan"))
    assert "DOES NOT FIT" not in plan and "zero3_qat (8 processes/node" in plan
    out = _snakemake_out(outs)
    assert _jobs(out) == FULL_DAG
    assert "torchrun --standalone --nproc_per_node=8" in _qat_shell(out)
    assert "--model-path Qwen/Qwen3-4B" in _qat_shell(out)


def test_how_to_upstream_angelslim_config_unchanged(how_to_runs):
    out = _snakemake_out(ran(how_to_runs, "upstream-config"))
    assert _jobs(out) == FULL_DAG
    qat = _qat_shell(out)
    assert "torchrun --standalone --nproc_per_node=8" in qat
    assert "qwen3-30b-a3b_fp8_static_end2end_learn_scale_zero3.yaml" in qat
    assert "ds_config_zero3.json" in qat  # upstream's own DeepSpeed JSON, found above the YAML


def test_how_to_2_x_8_gpus_on_slurm(how_to_runs):
    out = _snakemake_out(ran(how_to_runs, "slurm-2x8"))
    assert _jobs(out) == FULL_DAG
    job = out[out.index("rule zero3_qat:") :]
    res = next(line for line in job.splitlines() if line.strip().startswith("resources:"))
    for want in ("nodes=2", "tasks=2", "gres=gpu:8", "cpus_per_task=64", "mpi=srun"):
        assert want in res, (want, res)
    qat = _qat_shell(out)
    assert "srun --nodes=2 --ntasks=2" in qat and "torchrun --nnodes=2 --nproc_per_node=8" in qat
