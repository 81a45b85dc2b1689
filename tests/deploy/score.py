"""Score the test file through a scoring URL from inside a pod's network namespace, where Service
names resolve as in the cluster (``host.run``): ``python -m tests.deploy.score URL KEY_FILE CA``
prints ``{"replies": [[status, reply], ...], "bad_json": status, "no_token": status}`` as JSON."""

from __future__ import annotations

import json
import sys

import orjson

from serving.scoring.client import ScoringClient, requests_from_file
from tests.serving.helpers import TEST


def main(url: str, key_file: str, ca: str) -> None:
    client = ScoringClient(url, key_file=key_file, ca=ca)
    replies = []
    for body, ctype in requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 400):
        status, payload = client.post(body, ctype)
        replies.append([status, orjson.loads(payload)])
    bad_json = client.post(b"{not json", "application/json")[0]
    no_token = ScoringClient(url, ca=ca).post(b"[{}]")[0]
    print(json.dumps({"replies": replies, "bad_json": bad_json, "no_token": no_token}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
