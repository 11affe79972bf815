"""One rank of the property test's multi-rank cases (test_property.py launches it).

    property_worker.py OUT_DIR CASE_ID...

Writes OUT_DIR/rank<r>.pt: {case id: result or {"error", "traceback"}}, then leaves with
os._exit so a failed peer cannot hold up interpreter exit.
"""
from __future__ import annotations

import os
import sys
import warnings

import property_models
from dp_worker import error_result, save_and_exit


def main() -> None:
    out, ids = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    by_id = {case.id: case for case in property_models.cases()}
    results = {}
    warnings.simplefilter("ignore")
    for case_id in ids:
        try:
            results[case_id] = property_models.train(by_id[case_id], rank)
        except BaseException as error:  # noqa: BLE001 (reported to the test)
            results[case_id] = error_result(error)
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
