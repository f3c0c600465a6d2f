"""Stage `local_task`: a local lm-eval multiple-choice task built from held-out text.

    python scripts/local_task.py --test results/corpus/test.txt --task-dir results/corpus/tasks/qat_local_mc

Each item: a context from the text, its true continuation and distractor spans of the same
length from other paragraphs (`qatlib.offline.mc_task.build_local_mc_task`). The folder is named after
the task and holds ``<task>.jsonl`` + ``<task>.yaml``; pass the folder in ``evaluation.tasks``.
"""

from __future__ import annotations

import json
from pathlib import Path

import _common


def main(argv=None) -> int:
    ap = _common.parser(__doc__, config=False, model=False, save=False)
    ap.add_argument("--test", required=True, help="held-out text file")
    ap.add_argument("--task-dir", required=True, help="output folder; its name is the task name")
    ap.add_argument(
        "--config-json",
        default="{}",
        help="items, context_words, continuation_words, num_choices, seed, neighborhood",
    )
    args = ap.parse_args(argv)
    spec = json.loads(args.config_json)

    from qatlib.offline.mc_task import build_local_mc_task

    with _common.stage("local_task", args) as record:
        task_dir = Path(args.task_dir)
        info = build_local_mc_task(
            Path(args.test),
            task_dir,
            task=task_dir.name,
            n=spec.get("items", 200),
            seed=spec.get("seed", 0),
            context_words=spec.get("context_words", 48),
            continuation_words=spec.get("continuation_words", 12),
            num_choices=spec.get("num_choices", 4),
            neighborhood=spec.get("neighborhood"),  # distractors from the k paragraphs on either side
        )
        print(
            f"task {info['task']}: {info['items']} items, chance {info['chance']:.2f} ({info['include_path']})"
        )
        record.update(task=info["task"], items=info["items"], sha256=info["sha256"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
