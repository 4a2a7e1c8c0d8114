"""Evaluation of agents on coding task suites (CursorBench-style), through the agentic environment's episode code.

    tools/run_eval.py --tasks SUITE --agent SPEC --passes K --concurrency N --out RUN
      tasks.py      SUITE -> tasks (file, directory or builtin:NAME) and the suite's shape
      agents.py     SPEC -> a per-episode agent factory (script:DIR, endpoint:URL; local:CKPT served in-process)
      harness.py    tasks x passes -> episodes (megatron_ext/env/episode.py run_episode), one file each, resumable
      usage.py      transcript -> tokens by category (input, cached input, output) -> cost
      metrics.py    episodes -> summary.json (accuracy + intervals, pass@k, best-of-K, quality, efficiency, ...)
      stats.py      the intervals and tests, each named
      report.py     summary -> report.md / report.html with plots.py figures (document.py renders both)
      compare.py    --compare RUN_A RUN_B ... -> per-task differences and their significance
      outputs.py    the files a run directory ends with
"""
