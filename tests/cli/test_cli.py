"""The kvvmm command: map, plan, lab (without launching JupyterLab) and bench delegation."""

from __future__ import annotations

import html
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import kvvmm
from kvvmm import cli
from kvvmm.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]


def _trace(path: Path, arena_name: str = "scratch") -> Path:
    drv = kvvmm.TracingDriver(kvvmm.SimDriver("h200"))
    descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4096,
                                  page_size=16, dtype="bfloat16")
    owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                                reserved_tokens=4096, descs=descs, name="kvpool",
                                trace=drv.trace)
    owner.finalize(2048)
    arena = kvvmm.Arena(drv, reserve_bytes=64 * MiB, name=arena_name, trace=drv.trace)
    arena.commit(arena.allocate(8 * MiB), 4 * MiB)
    drv.trace.save(path)
    return path


# -- map ---------------------------------------------------------------------------------


def test_map_writes_a_standalone_html_page_of_every_arena_in_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src = _trace(tmp_path / "run.json")
    out = tmp_path / "map.html"
    assert cli.main(["map", str(src), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "kvpool" in page and "scratch" in page
    assert page.count("Plotly.newPlot") == 3  # two arena maps and the timeline
    assert 'src="http' not in page and len(page) > 1_000_000  # plotly.js inline: offline
    assert "wrote" in capsys.readouterr().out


def test_map_defaults_its_output_next_to_the_trace(tmp_path: Path) -> None:
    src = _trace(tmp_path / "run.json")
    assert cli.main(["map", str(src), "--no-timeline"]) == 0
    assert (tmp_path / "run.html").read_text(encoding="utf-8").count("Plotly.newPlot") == 2


def test_map_of_a_file_that_is_not_a_trace_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    assert cli.main(["map", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvvmm map: error: TraceFormatError") and err.count("\n") == 1


# The trace's name went into the page unescaped.
@pytest.mark.parametrize("name", ["<img src=x onerror=alert(1)>.json",
                                  "\"><svg onload=alert('q')>.json"])
def test_map_escapes_the_trace_name_in_the_page(tmp_path: Path, name: str) -> None:
    src = _trace(tmp_path / name)
    out = tmp_path / "map.html"
    assert cli.main(["map", str(src), "-o", str(out), "--no-timeline"]) == 0
    page = out.read_text(encoding="utf-8")
    assert name not in page
    assert f"<title>{html.escape('kvvmm map of ' + name)}</title>" in page


def test_map_keeps_a_hostile_arena_name_inside_the_figure_data(tmp_path: Path) -> None:
    src = _trace(tmp_path / "run.json", arena_name="</script><script>alert(1)</script>")
    out = tmp_path / "map.html"
    assert cli.main(["map", str(src), "-o", str(out), "--no-timeline"]) == 0
    assert "<script>alert(1)</script>" not in out.read_text(encoding="utf-8")


BROKEN_TRACES = {
    "not json": "{",
    "a list": "[1, 2, 3]",
    "events of the wrong type": '{"format": "kvvmm-trace", "version": 1, "events": 7}',
    "a name with a newline": '{"format": "bad\\nline"}',
}


# A broken trace must end in one line and exit 2, never a traceback.
@pytest.mark.parametrize("text", list(BROKEN_TRACES.values()), ids=list(BROKEN_TRACES))
def test_map_of_a_broken_trace_exits_2_with_one_line_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text(text, encoding="utf-8")
    assert cli.main(["map", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvvmm map: error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def _can_draw_images() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome"))


@pytest.mark.skipif(not _can_draw_images(), reason="needs kaleido and Chrome/Chromium")
def test_map_to_png_writes_one_png_per_figure(tmp_path: Path) -> None:
    src = _trace(tmp_path / "run.json")
    out = tmp_path / "map.png"
    assert cli.main(["map", str(src), "-o", str(out), "--no-timeline"]) == 0
    files = sorted(tmp_path.glob("map*.png"))
    assert [f.name for f in files] == ["map-0.png", "map-1.png"]  # one per arena
    assert all(f.read_bytes().startswith(b"\x89PNG\r\n") for f in files)


# -- plan --------------------------------------------------------------------------------


def test_plan_prints_the_plan_as_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--tp", "2",
                     "--budget-bytes", "40GiB"]) == 0
    out = capsys.readouterr().out
    from kvvmm.layout import plan
    from kvvmm.viz import format_plan

    expected = format_plan(plan(gpu="h200", model="llama-3.1-8b", tp=2,
                                budget_bytes=40 * GiB))
    first, rest = out.split("\n", 1)
    from kvvmm.hardware import profile_summary
    date = profile_summary("h200")["date"]
    assert first == (f"profile: h200 (NVIDIA H200, {date}; shipped); costs: h200, measured on "
                     "an H200; capacity: h200")
    assert rest == expected + "\n"
    assert "tokens" in out and "Chunked(64.0 MiB)" in out


def test_every_plan_flag_but_the_gpu_the_model_and_json_is_an_option_of_the_record() -> None:
    # The command hands plan() the flags named as PlanOptions' fields: a flag named
    # otherwise would be dropped without a word.
    from dataclasses import fields

    from kvvmm.layout import PlanOptions

    sub = next(a for a in cli._parser()._actions if a.dest == "cmd")
    flags = {a.dest for a in sub.choices["plan"]._actions} - {"help", "gpu", "model", "json"}
    assert flags and flags <= {f.name for f in fields(PlanOptions)}


def test_plan_json_parses_and_carries_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "qwen2.5-7b", "--page-size", "64", "--dtype", "fp16",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "qwen2.5-7b" and data["page_size"] == 64
    assert data["dtype"] == "float16" and data["tokens"] % 64 == 0
    assert isinstance(data["pools"], list) and data["pools"][0]["name"] == "full"


def test_plan_with_bad_input_exits_2_naming_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().err


def test_plan_names_every_term_of_the_budget_for_llama_70b_on_eight_h200s(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--model", "llama-3.1-70b", "--gpu", "h200", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    lines: dict[str, str] = {}
    for line in out.splitlines():
        if line.strip():
            lines.setdefault(line.split()[0], line)  # the first "backed" is the term
    assert "device memory before weights" in lines["total"]
    assert "16.4 GiB per rank (bfloat16" in lines["weights"]
    assert "mem_fraction_static 0.9" in lines["headroom"]
    assert "total - weights" in lines["free"] and "added back" in lines["backed"]
    assert "max(0, free - headroom) + backed, no token cap" in lines["budget"]
    assert "2,867,664" in lines["tokens"]  # was 3,559,... before weights and headroom counted
    assert "warning" not in out


def test_plan_takes_sglangs_memory_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--mem-fraction-static", "0.8", "--weights-dtype", "float8_e4m3fn",
                     "--max-total-tokens", "50000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mem_fraction_static"] == 0.8 and data["weights_dtype"] == "float8_e4m3fn"
    assert data["tokens"] == 50000 and data["max_total_tokens"] == 50000


def test_plan_prints_a_warning_line_for_an_absurd_reservation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--model", "llama-3.1-70b", "--tp", "8",
                     "--reserved-tokens", str(2**35)]) == 0
    warnings = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning: ")]
    assert len(warnings) == 2 and "VA reservation" in warnings[0] and "2**31" in warnings[1]


@pytest.mark.parametrize(("repo_id", "key"), [
    ("meta-llama/Llama-3.1-70B", "llama-3.1-70b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/meta-llama-3.1-8b-instruct", "llama-3.1-8b"),
    ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
    ("qwen/qwen2.5-7b-instruct", "qwen2.5-7b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ("openai/gpt-oss-120b", "gpt-oss-120b"),
    ("google/gemma-3-27b-it", "gemma-3-27b"),
])
def test_plan_takes_the_hugging_face_repo_ids_its_help_promises(
    capsys: pytest.CaptureFixture[str], repo_id: str, key: str,
) -> None:
    assert cli.main(["plan", "--model", repo_id, "--tp", "8", "--budget-bytes", "40GiB",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == key


def test_plan_of_an_unknown_repo_id_exits_2_listing_the_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--model", "meta-llama/Llama-9-1T"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama-3.1-8b" in err


@pytest.mark.parametrize(("text", "value"), [
    ("1024", 1024), ("80GiB", 80 * GiB), ("512 MiB", 512 * MiB), ("1.5GiB", 3 * GiB // 2),
    ("2GB", 2 * 10**9),
])
def test_sizes_on_the_command_line_take_units(text: str, value: int) -> None:
    assert cli.parse_bytes(text) == value


def test_a_size_without_a_known_unit_is_refused() -> None:
    with pytest.raises(SystemExit):
        cli.main(["plan", "--budget-bytes", "80 parsecs"])


# -- lab ---------------------------------------------------------------------------------


class _Launch:
    """Records what ``kvvmm lab`` would run instead of running it."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        self.calls.append((list(argv), dict(env)))
        return 0


def test_lab_opens_jupyterlab_on_the_notebooks_with_the_sim_driver_without_a_gpu() -> None:
    launch = _Launch()
    assert cli.main(["lab", "--no-browser", "--port", "8899"], launch=launch,
                    gpu_probe=lambda: False) == 0
    ((argv, env),) = launch.calls
    assert argv[1:4] == ["-m", "jupyter", "lab"]
    assert f"--ServerApp.root_dir={ROOT / 'notebooks' / '.work'}" in argv
    assert "--ServerApp.port=8899" in argv and "--no-browser" in argv
    assert "--LabApp.default_url=/lab/tree/01_tour.ipynb" in argv
    assert env["KVVMM_DRIVER"] == "sim"


def test_lab_allows_root_only_when_running_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    launch = _Launch()
    for root in (True, False):
        monkeypatch.setattr(cli.lab, "is_root", lambda root=root: root)
        cli.main(["lab"], launch=launch, gpu_probe=lambda: False)
    assert ["--allow-root" in argv for argv, _ in launch.calls] == [True, False]


def test_lab_picks_cuda_when_a_gpu_is_usable_and_honours_an_explicit_driver() -> None:
    launch = _Launch()
    cli.main(["lab"], launch=launch, gpu_probe=lambda: True)
    cli.main(["lab", "--driver", "host"], launch=launch, gpu_probe=lambda: True)
    assert [env["KVVMM_DRIVER"] for _, env in launch.calls] == ["cuda", "host"]
    assert "--no-browser" not in launch.calls[0][0]


def test_lab_passes_extra_arguments_to_jupyter() -> None:
    launch = _Launch()
    cli.main(["lab", "--", "--ServerApp.token=abc"], launch=launch, gpu_probe=lambda: False)
    assert launch.calls[0][0][-1] == "--ServerApp.token=abc"


def test_lab_without_a_notebooks_folder_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    launch = _Launch()
    assert cli.main(["lab", "--notebooks", str(tmp_path / "nope")], launch=launch,
                    gpu_probe=lambda: False) == 2
    assert launch.calls == [] and "no notebooks folder" in capsys.readouterr().err


def test_lab_opens_working_copies_in_an_ignored_folder_and_never_the_tracked_notebooks(
    tmp_path: Path,
) -> None:
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    (nbs / "01_tour.ipynb").write_text("{}", encoding="utf-8")
    launch = _Launch()
    assert cli.main(["lab", "--notebooks", str(nbs)], launch=launch,
                    gpu_probe=lambda: False) == 0
    (argv, _env), = launch.calls
    assert f"--ServerApp.root_dir={nbs / '.work'}" in argv
    assert (nbs / ".work" / "01_tour.ipynb").read_text(encoding="utf-8") == "{}"


def test_the_notebooks_are_found_from_the_repository_or_below_it(tmp_path: Path) -> None:
    assert cli.find_notebooks(ROOT) == ROOT / "notebooks"
    assert cli.find_notebooks(ROOT / "notebooks") == ROOT / "notebooks"
    assert cli.find_notebooks(tmp_path) == ROOT / "notebooks"  # next to the package


# -- version and bench -------------------------------------------------------------------


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"kvvmm {kvvmm.__version__}\n"


def test_bench_without_a_gpu_says_so_in_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    bench = pytest.importorskip("kvvmm.measure.bench")
    called: list[object] = []
    monkeypatch.setattr(bench, "main", lambda argv=None: called.append(argv) or 0)
    assert cli.main(["bench", "--out", "x"], gpu_probe=lambda: False) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvvmm bench: error: needs a CUDA GPU") and err.count("\n") == 1
    assert called == []  # the benchmarks never start


def test_bench_help_needs_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = pytest.importorskip("kvvmm.measure.bench")
    monkeypatch.setattr(bench, "main", lambda argv=None: 0)
    assert cli.main(["bench", "-h"], gpu_probe=lambda: False) == 0


def test_bench_hands_its_arguments_to_kvvmm_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = pytest.importorskip("kvvmm.measure.bench")
    seen: list[list[str]] = []

    def fake_main(argv: list[str] | None = None) -> int:
        seen.append(list(argv or []))
        return 3

    monkeypatch.setattr(bench, "main", fake_main)
    assert cli.main(["bench", "--out", "x.json", "--help"]) == 3
    assert cli.main(["bench", "--out", "y"], gpu_probe=lambda: True) == 3
    assert seen == [["--out", "x.json", "--help"], ["--out", "y"]]


# -- the seed's script (the package does not look for it in a checkout) ---------


def test_the_seed_script_is_taken_where_it_is_named(tmp_path: Path) -> None:
    from kvvmm.measure.bench import find_seed_script

    script = ROOT / "bench" / "seed" / "seed_side_by_side.py"
    assert find_seed_script(str(script)) == script
    with pytest.raises(FileNotFoundError, match="--seed-script"):
        find_seed_script(str(tmp_path / "seed_side_by_side.py"))


def test_without_a_named_seed_script_none_is_looked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvvmm.errors import ArgumentError
    from kvvmm.measure.bench import find_seed_script, main

    monkeypatch.chdir(ROOT)  # ./bench/seed/seed_side_by_side.py is here, and still not taken
    with pytest.raises(ArgumentError, match="--seed-script"):
        find_seed_script(None)
    seed = ROOT / "kv_vmm_backing_seed.py"  # never opened: the script is refused first
    assert main(["--seed-file", str(seed)]) == 2
    assert "--seed-script" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "replay"])
def test_gpu_help_says_a_profile_file_is_taken_and_the_output_names_the_file_used(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Calibrate-then-predict is visible: --gpu's help names profile files
    and `kvvmm calibrate`, and the output says which profile ran: key, card, date, path."""
    from kvvmm.cli import main
    from kvvmm.hardware import profile_summary

    with pytest.raises(SystemExit):
        main([command, "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert ".json" in helptext and "kvvmm calibrate" in helptext
    prof = tmp_path / "my-card.json"
    src = Path(__file__).resolve().parents[2] / "kvvmm" / "hardware" / "data" / "h200.json"
    shutil.copy(src, prof)
    args = [command, "--gpu", str(prof)]
    if command == "replay":
        args = ["replay", "generated", "--seconds", "20", "--strategy", "prefix", "--gpu",
                str(prof), "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    used = profile_summary(str(prof))
    assert used["path"] == str(prof.resolve()) and used["card"] == "NVIDIA H200"
    if command == "replay":
        assert json.loads(out)["profile"] == used
    else:
        assert out.splitlines()[0] == (f"profile: h200 (NVIDIA H200, {used['date']}; "
                                       f"{prof.resolve()}); costs: h200, measured on an H200; "
                                       "capacity: h200")
