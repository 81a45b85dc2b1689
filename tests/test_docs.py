"""Every command line of README.md and docs/*.md is run by a test: ``RUN`` says which test runs
each documented line as printed (a test that reads it from its document with ``doc_blocks``); a
line that no entry covers, an entry that covers no line, or one that names a test that does not
exist or does not read that document fails here. The README stays a front door (<= 250 lines)."""

import re

import pytest

from tests.helpers import ROOT, SHELL_FENCES, doc_files, doc_sections, split_comment

PARSED = "tests/recserve/test_cli.py::test_documented_line_parses_and_builds_its_config"
"""Parses a ``recserve`` line with the real parser and builds its config (every doc but hosts.md):
the check for the lines whose effect another test covers without running them as printed."""

RUN: list[tuple[str, str, str, str]] = [
    # (document, heading, line prefix ("": every line of the heading's blocks), test)
    ("README.md", "recserve", "make demo", "tests/test_make_demo.py::test_make_demo_runs_every_step"),
    ("README.md", "recserve", "make test", "tests/test_readme.py::test_readme_names_the_two_commands_and_ci_runs_make_test"),
    ("README.md", "A five-minute tour", "", "tests/test_quick_tour.py::test_quick_tour_runs_as_printed"),
    ("README.md", "Starting warm", "", "tests/recserve/test_warm.py::test_a_cache_recserve_warm_filled_holds_every_kernel_serve_starts_with"),
    ("docs/cli.md", "The recserve CLI", "recserve ", PARSED),
    ("docs/cli.md", "The recserve CLI", "recserve train --arch deepfm", "tests/test_readme_cli.py::test_tls_replicas_worker_and_publish_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve up --model criteo --tls", "tests/test_readme_cli.py::test_tls_replicas_worker_and_publish_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve up --model criteo --replicas 2", "tests/test_readme_cli.py::test_tls_replicas_worker_and_publish_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve worker --ps '", "tests/test_readme_cli.py::test_tls_replicas_worker_and_publish_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve publish", "tests/test_readme_cli.py::test_tls_replicas_worker_and_publish_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve down", "tests/test_readme_cli.py::test_tls_replicas_worker_and_publish_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve serve --model criteo", "tests/test_readme_cli.py::test_serve_and_colocated_up_lines_run_as_printed"),
    ("docs/cli.md", "The recserve CLI", "recserve up --model criteo --lookups colocated", "tests/test_readme_cli.py::test_serve_and_colocated_up_lines_run_as_printed"),
    ("docs/hosts.md", "Serving", "", "tests/test_readme_hosts.py::test_the_serving_lines_run_as_printed_across_three_hosts"),
    ("docs/hosts.md", "Training on several nodes", "", "tests/test_readme_hosts.py::test_two_nodes_train_on_torchrun_against_ps_on_two_hosts_and_a_fifth_serves_it"),
    ("docs/hosts.md", "Training on several nodes", "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv", "tests/test_readme_hosts.py::test_a_job_without_ps_starts_its_shards_on_every_node_bound_to_the_node"),
    ("docs/hosts.md", "Training on several nodes", "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --rdzv", "tests/test_readme_hosts.py::test_a_job_without_ps_starts_its_shards_on_every_node_bound_to_the_node"),
    ("docs/kubernetes.md", "The Secret's files", "", "tests/deploy/test_kubernetes_roles.py::test_every_pod_of_the_small_overlay_runs_as_its_manifest_says_and_scores"),
    ("docs/kubernetes.md", "The Secret's files", "recserve certs", "tests/deploy/test_kubernetes.py::test_the_documented_certificate_names_every_address_a_client_dials_and_pods_get_their_files"),
    ("docs/kubernetes.md", "In a cluster", "recserve score", PARSED),
    ("docs/training.md", "Sharding plans: where each table trains", "", "tests/training/planning/test_plan.py::test_the_documented_plan_lines_run_as_printed_and_the_plan_printed_is_the_plan_trained"),
    ("docs/training.md", "Checkpoints and restarts", "recserve train", "tests/training/test_checkpoint.py::test_resume_continues_exactly_where_the_checkpoint_left_off"),
    ("docs/training.md", "Checkpoints and restarts", "torchrun", "tests/training/test_checkpoint.py::test_torchrun_restarts_every_rank_from_the_checkpoint_after_one_is_killed"),
    ("docs/training.md", "Data at scale", "", "tests/test_readme_scale.py::test_data_at_scale_runs_as_printed"),
    ("docs/streaming.md", "Try it on one machine", "", "tests/stream/test_docs_streaming.py::test_the_try_it_lines_run_as_printed"),
    ("docs/streaming.md", "recserve join", "recserve join", PARSED),
    ("docs/streaming.md", "Full versions from the stream", "", "tests/training/follow/test_full_version.py::test_the_documented_full_version_lines_run_as_printed"),
    ("docs/training.md", "Training from the stream", "", "tests/training/follow/test_stream.py::test_the_documented_lines_train_exactly_once_across_a_sigkill"),
    ("docs/training.md", "Streaming ranks on several hosts", "", "tests/training/follow/test_ranks_hosts.py::test_a_killed_rank_comes_back_and_both_ranks_follow_a_new_version_training_every_sample_once"),
    ("docs/serving.md", "Update notices", "", "tests/serving/notices/test_docs_notices.py::test_the_notices_lines_run_as_printed"),
    ("docs/serving.md", "Serving dtypes under a memory budget", "", "tests/training/planning/test_serving_plan.py::test_the_documented_plan_and_train_lines_run_as_printed"),
    ("docs/serving.md", "Serving in float16 or int8", "recserve train", "tests/training/test_quantized_export.py::test_the_documented_versions_and_publish_lines_run_as_printed"),
    ("docs/serving.md", "Serving in float16 or int8", "recserve versions", "tests/training/test_quantized_export.py::test_the_documented_versions_and_publish_lines_run_as_printed"),
    ("docs/serving.md", "Serving in float16 or int8", "recserve publish", "tests/training/test_quantized_export.py::test_the_documented_versions_and_publish_lines_run_as_printed"),
    ("docs/serving.md", "The dense model on a GPU", "recserve serve", PARSED),
    ("docs/guards-and-experiments.md", "The input guard", "", "tests/stream/test_docs_guards.py::test_the_input_guard_lines_run_as_printed"),
    ("docs/guards-and-experiments.md", "Running an experiment", "", "tests/stream/test_docs_guards.py::test_an_experiment_the_rule_decides_runs_as_printed"),
    ("docs/guards-and-experiments.md", "By hand", "", "tests/stream/test_docs_guards.py::test_the_by_hand_lines_run_as_printed"),
    # a streaming trainer at the output guard's defaults needs 16,000 samples before it judges:
    # tests/training/follow/test_output_guard.py trips, rewinds and clears one in-process
    ("docs/guards-and-experiments.md", "The output guard", "recserve train", PARSED),
    # tests/training/follow/test_canary.py runs --canary-share's trainer: promoted, aborted, refused
    ("docs/guards-and-experiments.md", "Canary for versions from the stream", "recserve train", PARSED),
    ("docs/benchmarks.md", "The dense half on a GPU", "python -m loadtest.bench_gpu", "tests/loadtest/test_bench_gpu.py::test_the_cpu_rehearsal_runs_every_section"),
]  # fmt: skip

CLUSTER_ONLY = ("docs/kubernetes.md", "In a cluster", ("buildah ", "kubectl "))
"""Lines that need a Kubernetes cluster and a registry; tests/deploy/test_kubernetes*.py stand in
for them (the overlay built and validated, every pod run in a network namespace as it says)."""


def documented_lines() -> list[tuple[str, tuple[str, ...], str]]:
    """(document, headings, command) of every line of a shell block in README.md and docs/."""
    return [
        (doc, titles, split_comment(line)[0])
        for doc in doc_files()
        for titles, lang, block in doc_sections(doc)
        if lang in SHELL_FENCES
        for line in block
    ]


def covers(entry: tuple[str, str, str, str], doc: str, titles: tuple[str, ...], command: str) -> bool:
    return entry[0] == doc and entry[1] in titles and command.startswith(entry[2])


def test_every_documented_command_line_is_run_by_a_test():
    lines = documented_lines()
    assert len(lines) >= 50, len(lines)  # the parser still finds the blocks
    cluster_doc, cluster_heading, cluster_commands = CLUSTER_ONLY
    uncovered = [
        f"{doc} ({titles[-1]}): {command}"
        for doc, titles, command in lines
        if not any(covers(entry, doc, titles, command) for entry in RUN)
        and not (doc == cluster_doc and cluster_heading in titles and command.startswith(cluster_commands))
    ]
    assert not uncovered, "no test runs these documented lines (add the test to RUN):\n" + "\n".join(
        uncovered
    )


@pytest.mark.parametrize("entry", RUN, ids=[f"{doc}:{prefix or heading}" for doc, heading, prefix, _ in RUN])
def test_each_entry_covers_a_line_and_names_a_test_that_reads_its_document(entry):
    doc, _, _, test = entry
    assert any(covers(entry, *line) for line in documented_lines()), f"{entry}: covers no documented line"
    path, name = test.split("::")
    source = (ROOT / path).read_text()
    assert re.search(rf"^def {name}\(", source, re.M), f"{path} has no test {name}"
    reads = doc in source or (test == PARSED and "doc_files()" in source)
    assert reads, f"{path} does not read {doc}: its lines must come from the document"


def test_the_cluster_only_lines_are_those_of_their_block():
    doc, heading, commands = CLUSTER_ONLY
    block = [command for d, titles, command in documented_lines() if d == doc and heading in titles]
    assert (
        sum(command.startswith(commands) for command in block) == len(block) - 1
    )  # and its `recserve score`


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    linked = set(re.findall(r"\]\((docs/[a-z-]+\.md)", "\n".join(lines)))
    assert linked == set(doc_files()) - {"README.md"}, linked  # every guide linked from the README


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def test_every_link_between_the_documents_resolves():
    broken = []
    for doc in doc_files():
        text = (ROOT / doc).read_text()
        for target, fragment in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]+))?\)", text):
            path = (ROOT / doc).parent / target if target else ROOT / doc
            if not path.exists():
                broken.append(f"{doc}: {target}")
            elif fragment and path.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
                if fragment not in {anchor(h) for h in headings}:
                    broken.append(f"{doc}: {target}#{fragment}")
    assert not broken, broken
