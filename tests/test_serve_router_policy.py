"""The replica-choice policy on its own: least work, prefix affinity within an allowance."""

from collections import Counter

from tpserve.serve.router_policy import PolicyConfig, PrefixAwareLeastWork, estimate_tokens

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 8  # ~470 chars


def test_least_work_first_from_reports_and_from_own_outstanding():
    p = PrefixAwareLeastWork(seed=0)
    assert p.rank("hi", ["a", "b", "c"], {"a": 50, "b": 10, "c": 30}) == ["b", "c", "a"]
    # What this router sent and is not done yet counts even before a replica reports it.
    p.on_routed("b", "x", 100)
    assert p.rank("hi", ["a", "b", "c"], {"a": 50, "b": 10, "c": 30})[0] == "c"
    p.on_completed("b", 100)
    assert p.rank("hi", ["a", "b", "c"], {"a": 50, "b": 10, "c": 30})[0] == "b"


def test_idle_replicas_share_requests_of_unrelated_prompts():
    p = PrefixAwareLeastWork(seed=1)
    first = Counter()
    for i in range(40):
        prompt = f"unrelated prompt number {i}"
        r = p.rank(prompt, ["a", "b"])[0]
        first[r] += 1
        p.on_routed(r, prompt, 10)
        p.on_completed(r, 10)
    assert first["a"] >= 10 and first["b"] >= 10, first


def test_balanced_under_load_without_shared_prefixes():
    p = PrefixAwareLeastWork(seed=2)
    for i in range(32):
        prompt = f"{i} " * 40
        r = p.rank(prompt, ["a", "b"])[0]
        p.on_routed(r, prompt, 100)
    assert abs(p.outstanding("a") - p.outstanding("b")) <= 100


def test_prefix_holder_preferred_while_not_much_busier():
    p = PrefixAwareLeastWork(PolicyConfig(imbalance_tokens=300, imbalance_ratio=0.0), seed=3)
    p.on_routed("a", SYSTEM + "question 1", 200)
    # "a" holds the prefix and is 200 tokens busier than idle "b": still preferred.
    assert p.rank(SYSTEM + "question 2", ["a", "b"])[0] == "a"
    # A prompt that shares nothing goes to the least loaded.
    assert p.rank("something else entirely " * 5, ["a", "b"])[0] == "b"
    # Once "a" is more than the allowance busier, least work wins.
    p.on_routed("a", SYSTEM + "question 3", 200)
    assert p.rank(SYSTEM + "question 4", ["a", "b"])[0] == "b"


def test_longest_matching_prefix_wins():
    p = PrefixAwareLeastWork(seed=4)
    long_prefix = SYSTEM + "Context: " + "the quick brown fox " * 20
    p.on_routed("a", SYSTEM + "short", 10)
    p.on_routed("b", long_prefix + "question", 10)
    assert p.rank(long_prefix + "another question", ["a", "b", "c"])[0] == "b"
    assert p.matched_chunks("b", p.prefix_hashes(long_prefix)) > p.matched_chunks(
        "a", p.prefix_hashes(long_prefix)) > 0


def test_shared_prefix_workload_lands_mostly_on_one_replica():
    p = PrefixAwareLeastWork(seed=5)
    counts = Counter()
    for i in range(32):
        prompt = SYSTEM + f"Question {i}: what is {i} + {i}?"
        cost = estimate_tokens(prompt, 16)
        r = p.rank(prompt, ["a", "b"])[0]
        counts[r] += 1
        p.on_routed(r, prompt, cost)  # all 32 in flight at once: none completes
    # The holder takes requests until it is the allowance busier, then shares: it keeps the
    # prefix even after one request spilled over to the other replica.
    assert counts.most_common(1)[0][1] >= 20, counts
    assert min(counts.values()) >= 4, counts


def test_forgotten_replica_loses_its_prefixes():
    p = PrefixAwareLeastWork(seed=6)
    p.on_routed("a", SYSTEM, 10)
    p.forget("a")
    assert p.matched_chunks("a", p.prefix_hashes(SYSTEM)) == 0
    assert p.outstanding("a") == 0


def test_prefix_memory_is_bounded():
    p = PrefixAwareLeastWork(PolicyConfig(chunk_chars=8, prefixes_per_replica=10), seed=7)
    for i in range(20):
        p.on_routed("a", f"prompt {i:03d} " * 4, 1)
    assert len(p._prefixes["a"]) == 10  # noqa: SLF001 - the bound is the point of the test
    assert p.prefix_hashes("short") == []
    assert p.rank("anything", []) == []


def test_policy_imports_neither_ray_nor_torch():
    import subprocess
    import sys

    code = ("import sys, tpserve.serve.router_policy; "
            "assert not {'ray', 'torch'} & set(sys.modules), 'ray or torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_work_tokens_a_replica_reports():
    from tpserve.engine.core import work_tokens
    from tpserve.engine.request import SamplingParams
    from tpserve.engine.sequence import Sequence

    waiting = Sequence(1, [7] * 10, SamplingParams(max_new_tokens=5))
    running = Sequence(2, [7] * 4, SamplingParams(max_new_tokens=3), output_ids=[9, 9],
                       num_computed=5)  # prompt and first token cached, last one pending
    assert work_tokens([waiting]) == 10 + 5
    assert work_tokens([running]) == 1 + 1
    assert work_tokens([waiting, running]) == 17
    assert work_tokens([]) == 0
