"""An 80-column console: at COLUMNS=80 no command's help or fast default output has a line
longer than 80 characters, cuts or splits a word, or wraps a table row; `--version` and
the defaults of `astro serve` show; and one flag vocabulary (`--request-rate`, `--path`,
`--policy`, default power_of_k) across bench, simulate and serve, the old simulate names
kept as hidden aliases that warn.

Width: Rich's consoles (the CLI's `console` and the ones print_summary makes) read
$COLUMNS when they print, click's help formatter reads it through
`shutil.get_terminal_size`, so `env={"COLUMNS": "80"}` sets both."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app

W = 80
ENV = {"COLUMNS": str(W)}
runner = CliRunner()


def _walk(cmd, path: list[str]) -> Iterator[tuple[list[str], object]]:
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _walk(sub, [*path, name])


COMMANDS = list(_walk(typer.main.get_command(app), []))


def _long_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > W]


def _source_words(cmd) -> set[str]:
    """The words of a command's own help text and of its options' help, as written in the
    source: each must show whole in its --help (a word cut with "…", split at a hyphen or
    folded mid-word does not). Comma lists may break after a comma, so they are left out."""
    texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params if not getattr(p, "hidden", False)]
    words = set()
    for t in texts:
        for w in t.split():
            w = w.strip("\b\\")
            if w and "," not in w.rstrip(",") and w != "\b":
                words.add(w)
    return words


def _option_names(cmd) -> set[str]:
    return {o for p in cmd.params if not getattr(p, "hidden", False)
            for o in [*p.opts, *getattr(p, "secondary_opts", [])] if o.startswith("--")}


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "astro" for p, _ in COMMANDS])
def test_help_fits_80_columns_and_keeps_every_word_whole(path, cmd):
    res = runner.invoke(app, [*path, "--help"], env=ENV)
    assert res.exit_code == 0, res.output
    out = res.output
    assert not _long_lines(out), _long_lines(out)
    assert "…" not in out  # nothing cut to fit
    assert "<bool>" not in out  # a flag takes no value
    shown = " ".join(out.split())
    tokens = set(shown.split())
    missing = sorted(n for n in _option_names(cmd) if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", out))
    assert not missing, f"option names cut or split in {' '.join(path)} --help: {missing}"
    broken = sorted(w for w in _source_words(cmd) if w not in tokens and w not in shown)
    assert not broken, f"words split or cut in {' '.join(path)} --help: {broken[:10]}"


def test_version_prints_the_version_and_its_help_row_takes_no_value():
    from rps_astro_cli import __version__

    res = runner.invoke(app, ["--version"], env=ENV)
    assert res.exit_code == 0 and res.output == f"astro {__version__}\n"
    row = next(line for line in runner.invoke(app, ["--help"], env=ENV).output.splitlines() if "--version" in line)
    assert "<bool>" not in row and "BOOL" not in row.upper().replace("--VERSION", ""), row


def test_serve_help_shows_the_defaults_of_instances_policy_and_port():
    from rps_astro_cli.services.config import ClusterConfig

    cfg = ClusterConfig()
    text = " ".join(runner.invoke(app, ["serve", "--help"], env=ENV).output.split())
    for flag, default in (("--instances", cfg.num_instances), ("--policy", cfg.scheduler.policy),
                          ("--port", cfg.scheduler.port), ("--k", cfg.scheduler.k)):
        # the metavar is "<int>" with newer click / typer, "INTEGER" with the lowest allowed
        m = re.search(rf"{flag} (?:<\w+>|[A-Z]+) .*?\[default: ([^\]]+)\]", text)
        assert m and m.group(1).startswith(f"{default},"), (flag, m and m.group(1))


# -- default outputs that are tables ---------------------------------------------------------

def _table_body(text: str) -> tuple[str, list[str]]:
    """(header line, body lines) of the first Rich table in `text`: the line above its
    header rule (─/━) and the lines after it up to the first blank one."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if re.fullmatch(r"\s*[─━┡╇┩]+\s*", line))
    body = []
    for line in lines[i + 1:]:
        if not line.strip() or set(line.strip()) <= set("─━└┴┘"):
            break
        body.append(line)
    return lines[i - 1], body


def _assert_no_wrapped_row(text: str, labels: list[str], last_filled: bool = True) -> None:
    """No table row continues on a second line, and every label shows whole on one line.
    A continuation line has a blank first cell (another cell wrapped) or a blank last cell
    (the first cell, the label, wrapped): every body line must fill both, the last one
    (right-aligned numbers) ending where the header's last name ends. `last_filled`
    False: the last column may be blank (the label check then catches a label that wraps)."""
    header, body = _table_body(text)
    first = len(header) - len(header.lstrip(" │┃"))
    last = len(header.rstrip(" │┃")) - 1
    wrapped = [line for line in body if not line[first:first + 1].strip(" │┃")
               or last_filled and not line[last:last + 1].strip()]
    assert not wrapped, f"wrapped rows: {wrapped}"
    for lab in labels:
        assert any(lab in line for line in text.splitlines()), f"label {lab!r} not whole on one line"


def test_policies_is_one_line_per_policy_with_a_short_description():
    from rps_astro_cli.cli.policies import policy_rows

    rows = policy_rows()
    res = runner.invoke(app, ["policies"], env=ENV)
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert not _long_lines(res.output), _long_lines(res.output)
    named = {}
    for line in lines:
        m = re.match(r"  (\S+)\s+(\d+)  \S", line)
        if m and m.group(1) != "name":
            named[m.group(1)] = int(m.group(2))
    assert named == {r["name"]: len(r["params"]) for r in rows}
    # nothing but the rows, a header per family, the column names and the footer
    assert len([line for line in lines if line.strip()]) == len(rows) + 2 * 2 + 1, res.output


def test_policies_verbose_lists_every_parameter_whole_within_80_columns():
    from rps_astro_cli.cli.policies import policy_rows

    res = runner.invoke(app, ["policies", "--verbose"], env=ENV)
    assert res.exit_code == 0
    assert not _long_lines(res.output), _long_lines(res.output)
    lines = res.output.splitlines()
    for r in policy_rows():
        assert any(line.startswith(f"{r['name']} (") for line in lines), r["name"]
        for p in r["params"]:
            assert any(line.startswith(f"  - {p['name']}: ") for line in lines), (r["name"], p["name"])
        words = {w for w in r["summary"].split() if "," not in w.rstrip(",")}
        assert words <= set(res.output.split()), (r["name"], sorted(words - set(res.output.split())))


def test_profiles_list_headers_whole_and_rows_unwrapped():
    from rps_astro_cli.sim.profile import list_profiles

    res = runner.invoke(app, ["profiles", "list"], env=ENV)
    assert res.exit_code == 0
    assert not _long_lines(res.output), _long_lines(res.output)
    assert "…" not in res.output
    header, _ = _table_body(res.output)
    assert header.split() == ["id", "GPU×TP", "blocks", "dec1", "dec48", "pf512", "MAPE%"]
    _assert_no_wrapped_row(res.output, list(list_profiles()))


def test_profiles_show_fits_80_columns():
    res = runner.invoke(app, ["profiles", "show", "llama-2-7b-a30"], env=ENV)
    assert res.exit_code == 0
    assert not _long_lines(res.output), _long_lines(res.output)
    for term in ("decode_attn_s_per_ctx_token", "prefill_attn_s_per_token_pair", "max_num_batched_tokens"):
        assert re.search(rf"(?<!\S){term}(?!\S)", res.output), term


def _bench(*args: str):
    res = runner.invoke(app, ["bench", "--virtual", "--instances", "2", "-w", "synthetic", "--no-report", *args],
                        env=ENV)
    assert res.exit_code == 0, res.output
    return res


def test_bench_summary_run_labels_stay_on_one_line():
    res = _bench("-n", "20", "--policies", "round_robin,power_of_k", "--k", "2,all", "--request-rate", "5")
    out = res.stdout
    assert not _long_lines(out), _long_lines(out)
    _assert_no_wrapped_row(out, ["round_robin", "power_of_k k=2", "power_of_k k=all"])
    assert "poisson 5 req/s" in out  # the arrivals every run shares: in the title


def test_virtual_summary_leaves_out_the_itl_column_it_cannot_measure():
    # the virtual cluster times no chunks: its ITL cell was "n/a" in every row
    out = _bench("-n", "20", "--request-rate", "5").stdout
    head = next(line for line in out.splitlines() if "ok/all" in line)
    assert "ITL" not in out and "n/a" not in out
    assert head.split()[:2] == ["run", "ok/all"] and "TPOT" in out and "E2E" in out


def test_bench_capacity_notes_do_not_wrap_table_rows():
    res = _bench("-n", "30", "--policies", "round_robin,power_of_k", "--k", "all", "--capacity",
                 "--capacity-max-rate", "8")
    out = res.stdout
    assert not _long_lines(out), _long_lines(out)
    cap = out[out.index("SLO capacity"):]
    _assert_no_wrapped_row(cap, ["round_robin", "power_of_k k=all"])
    # the summary of a capacity sweep (many rates): labels numbered, legend whole
    _assert_no_wrapped_row(out, [])


def test_bench_progress_lines_fit_80_columns():
    res = _bench("-n", "10", "--policies", "power_of_k", "--k", "all", "--request-rate", "5")
    done = [line for line in res.stderr.splitlines() if "done" in line and "ok," in line or "P99 TTFT" in line]
    assert done and not [line for line in done if len(line) > W], done


# -- one flag vocabulary ---------------------------------------------------------------------

@pytest.fixture()
def trace(tmp_path):
    t = tmp_path / "t.csv"
    t.write_text("Timestamp,Model,Request tokens,Response tokens\n0,x,20,5\n1,x,30,4\n2,x,40,7\n")
    return t


def _simulate(tmp_path, *args: str):
    return runner.invoke(app, ["simulate", "-n", "5", "--instances", "2", "--out", str(tmp_path / "r.jsonl"), *args],
                         env=ENV)


def test_simulate_old_flag_names_still_work_and_warn_once(tmp_path, trace):
    old = _simulate(tmp_path, "--trace", str(trace), "--rate", "50")
    new = _simulate(tmp_path, "--path", str(trace), "--request-rate", "50")
    assert old.exit_code == 0 and new.exit_code == 0, old.output + new.output
    assert old.stderr.count("--rate is deprecated; use --request-rate") == 1
    assert old.stderr.count("--trace is deprecated; use --path") == 1
    assert "deprecated" not in new.stderr
    same = [" ".join(r.stdout.split()).split("; simulated in")[0] for r in (old, new)]
    assert same[0] == same[1] and "at 50 req/s" in same[1]
    both = _simulate(tmp_path, "--path", str(trace), "--trace", str(trace))
    assert both.exit_code == 2 and "--trace" in both.output
    bad = _simulate(tmp_path, "--path", str(trace), "--request-rate", "0")  # errors name the flag given
    assert bad.exit_code == 2 and "--request-rate: must be > 0" in bad.output and "--rate" not in bad.output
    bad = _simulate(tmp_path, "--path", str(tmp_path / "absent.csv"))
    assert bad.exit_code == 2 and "--path: no such trace file" in bad.output
    help_text = runner.invoke(app, ["simulate", "--help"], env=ENV).output
    assert "--request-rate" in help_text and "--path" in help_text
    assert not re.search(r"--rate\b", help_text) and "--trace" not in help_text  # hidden aliases


def test_serve_n_is_a_deprecated_alias_of_instances(tmp_path):
    # -n is --num-requests in bench, simulate and demo; serve's -n (its --instances) warns
    old = runner.invoke(app, ["serve", "-n", "0", "--run-dir", str(tmp_path / "r")], env=ENV)
    assert old.exit_code == 2 and old.stderr.count("-n is deprecated; use --instances") == 1
    assert "--instances 0: must be ≥ 1" in old.output
    both = runner.invoke(app, ["serve", "-n", "2", "--instances", "3", "--run-dir", str(tmp_path / "r")], env=ENV)
    assert both.exit_code == 2 and "give --instances only" in both.output
    assert not re.search(r"(^|[\s,])-n\b", runner.invoke(app, ["serve", "--help"], env=ENV).output)


def test_bench_and_serve_take_the_same_names():
    bench = {o for p in typer.main.get_command(app).commands["bench"].params for o in p.opts}
    simulate = {o for p in typer.main.get_command(app).commands["simulate"].params for o in p.opts}
    serve = typer.main.get_command(app).commands["serve"]
    serve_opts = {o for p in serve.params for o in p.opts}
    sched_opts = {o for p in serve.commands["scheduler"].params for o in p.opts}
    assert {"--request-rate", "--path", "--policy", "--k", "--param", "--instances", "--profile",
            "--instance-policy", "--instance-param", "--recipe"} <= bench & simulate
    assert {"--policy", "--k", "--param", "--instances", "--profile", "--instance-policy", "--instance-param",
            "--recipe"} <= serve_opts
    assert {"--policy", "--k", "--param"} <= sched_opts
    res = _bench("-n", "5", "--policy", "round_robin", "--request-rate", "5")
    assert "round_robin" in res.stdout


def test_default_dispatch_policy_is_power_of_k_everywhere(tmp_path, trace):
    from rps_astro_cli.cli.simulate import DEFAULT_POLICY
    from rps_astro_cli.services.config import ClusterConfig

    assert DEFAULT_POLICY == ClusterConfig().scheduler.policy == "power_of_k"
    sim = _simulate(tmp_path, "--path", str(trace), "--request-rate", "50")
    assert sim.exit_code == 0 and "power_of_k at 50 req/s" in sim.stdout
    bench = _bench("-n", "5", "--request-rate", "5")
    _, body = _table_body(bench.stdout)
    assert [line.split()[0] for line in body] == ["power_of_k"]
    sched = next(p for p in typer.main.get_command(app).commands["serve"].commands["scheduler"].params
                 if p.name == "policy")
    assert sched.default == "power_of_k"


def test_serve_endpoint_table_keeps_urls_and_profiles_whole(capsys, monkeypatch):
    from rps_astro_cli.cli.serve import _print_table

    monkeypatch.setenv("COLUMNS", str(W))
    profiles = ["llama-2-7b-a30", "llava-onevision-7b-a100-testbed"]
    info = {"name": "c", "policy": "power_of_k", "model": "m",
            "scheduler": {"openai_base_url": "http://127.0.0.1:45678/v1", "pid": 12345},
            "tagger": {"url": "http://127.0.0.1:45679", "pid": 12346},
            "instances": [{"name": f"engine-{i}", "engine_url": f"http://127.0.0.1:4570{i}", "engine_pid": 2000 + i,
                           "profile": p, "predictor_url": f"http://127.0.0.1:4580{i}", "predictor_pid": 3000 + i,
                           "assumed_profile": p} for i, p in enumerate(profiles)]}
    _print_table(info, "cluster.json")
    out = capsys.readouterr().out
    assert not _long_lines(out), _long_lines(out)
    _assert_no_wrapped_row(out, ["http://127.0.0.1:45678/v1", "http://127.0.0.1:45801", *profiles],
                           last_filled=False)


def test_live_and_virtual_runs_of_the_default_policy_share_a_label():
    """A live cluster's policy (cluster.json) shows its k only when it is not the default,
    as a virtual run of `power_of_k` without --k does."""
    from rps_astro_cli.bench.arrivals import ArrivalSpec
    from rps_astro_cli.bench.runner import _label

    spec = ArrivalSpec("poisson", 5.0)
    virtual = _label("power_of_k", None, spec)
    assert virtual.startswith("power_of_k @ ")
    assert _label(None, None, spec, {"policy": {"name": "power_of_k", "k": "auto"}}) == virtual
    assert _label(None, None, spec, {"policy": {"name": "power_of_k", "k": 2}}).startswith("power_of_k k=2 @ ")
    assert _label(None, None, spec, {"policy": {"name": "power_of_k", "k": "all"}}).startswith("power_of_k k=all @")
    assert _label(None, None, spec, None).startswith("server @ ")
