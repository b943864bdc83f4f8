"""workbench.child: records survive a crash or a hang of the child."""
import textwrap

from workbench.child import run_records


def test_records_and_clean_exit():
    code = textwrap.dedent("""
        import json, os, sys
        print("not a record")
        for a in sys.argv[1:]:
            print(json.dumps({"arg": a, "interp": os.environ.get("TRITON_INTERPRET")}))
        print("{broken")
    """)
    r = run_records(code, ["x", "y"], timeout_s=60)
    assert not r.hung and r.error is None
    assert r.records == [{"arg": "x", "interp": None}, {"arg": "y", "interp": None}]  # TRITON_INTERPRET dropped


def test_crash_keeps_records_and_says_why():
    code = 'import json; print(json.dumps({"done": 1}), flush=True); raise SystemExit("boom at case 2")'
    r = run_records(code, [], timeout_s=60)
    assert r.records == [{"done": 1}] and not r.hung
    assert r.error.startswith("child exited 1:") and "boom at case 2" in r.error


def test_hang_is_killed_and_keeps_records():
    code = 'import json, time; print(json.dumps({"done": 1}), flush=True); time.sleep(60)'
    r = run_records(code, [], timeout_s=3)
    assert r.hung and r.records == [{"done": 1}]
