"""Every threshold the doctor's rules use, in one place, each with its rationale.

Rules read a :class:`Thresholds` instance passed to them (never module globals), so tests and users
can tighten or relax one number without touching rule code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """Limits at which a symptom becomes a finding. Times in ms, shares and ratios as fractions."""

    queue_share_of_ttft: float = 0.5
    """Queueing: server queue time / server TTFT (medians) at or above which waiting dominates TTFT.
    Half is the point where adding capacity helps more than any prefill optimisation."""

    min_queue_ms: float = 20.0
    """Queueing: median queue time below this is never a finding (one engine step on a GPU is
    10-50 ms, so shorter waits are just step alignment)."""

    min_queue_steps: float = 2.0
    """Queueing: median queue time below this many engine steps (the median TPOT at that load: one
    decode step per token) is never a finding either. Iteration-level schedulers admit a new request
    between steps, so an arrival waits for the step in progress: 10-50 ms on a GPU, but several hundred
    on a CPU, where the fixed ``min_queue_ms`` alone named every busy CPU server "queued" (measured on
    the real kvpilot server: 4 clients, 280 ms median wait = 1.7 steps of 162 ms, 40% of TTFT)."""

    min_waiting_mean: float = 1.0
    """Queueing from metrics alone: mean ``num_requests_waiting`` during the run at or above this means
    a queue persisted rather than flickered."""

    tokenize_share_of_ttft: float = 0.25
    """Tokenization: tokenize time / server TTFT at or above which preprocessing is a bottleneck
    (fast tokenizers take ~1 ms per 1k tokens, a few percent of a healthy TTFT)."""

    min_tokenize_ms: float = 5.0
    """Tokenization: median tokenize time below this is never a finding."""

    kv_usage_high: float = 0.9
    """KV pressure: peak KV-cache usage at or above this leaves no room for a new request's blocks."""

    kv_usage_warn: float = 0.75
    """KV pressure, low severity: peak usage at or above this (without preemptions) is a note that
    the pool is filling up: a burst or longer prompts would start queueing."""

    preemptions_per_request_high: float = 0.05
    """KV pressure: preemptions per finished request at or above this make the finding high severity
    (each preemption recomputes a whole prefill); any preemption at all is medium."""

    prefill_min_correlation: float = 0.7
    """Prefill-bound: Pearson correlation of prompt length and prefill time (or TTFT) needed to say
    TTFT grows with prompt length."""

    prefill_length_share: float = 0.5
    """Prefill-bound: share of p90 TTFT explained by prompt length (slope x length spread)."""

    ttft_high_ms: float = 500.0
    """TTFT (p90) above which a prompt-length effect is worth fixing when the run has no TTFT SLO;
    about the delay at which chat users notice a stall."""

    min_length_spread: float = 2.0
    """Prefill-bound / long-short: p90 / p10 prompt length needed to see any length effect."""

    decode_roofline_efficiency_low: float = 0.3
    """Decode-bound: measured per-sequence decode speed at the lowest concurrency / roofline bound
    below this means the kernels or memory path waste bandwidth (good engines reach 0.5-0.8)."""

    tpot_growth_high: float = 2.0
    """Decode-bound: median TPOT at the highest / lowest concurrency at or above this means decode
    slows with batch size (memory-bound decode should stay nearly flat until the compute-bound batch)."""

    min_concurrency_ratio: float = 4.0
    """Rules comparing runs (static batching, TPOT growth) need the highest concurrency to be at least
    this multiple of the lowest."""

    flat_throughput_ratio: float = 1.3
    """Static batching: output throughput at the highest / lowest concurrency below this is flat
    (continuous batching normally gains 3x or more over 4x concurrency before the knee)."""

    itl_spike_ratio: float = 5.0
    """Interactivity: a gap at least this multiple of the median inter-token latency is a stall."""

    min_itl_spike_ms: float = 50.0
    """Interactivity: gaps shorter than this are never stalls (below what a reader notices)."""

    spike_overlap_share: float = 0.5
    """Interactivity: share of stalls that coincide with another request's long prefill needed to
    blame prefill batching; random stalls (GC, network) coincide far less often."""

    long_prefill_share: float = 0.3
    """Long prompts stall decodes (seen in the server's metrics, rules/foreign_prefill.py): long prompts the
    measured clients did not send took at least this share of the engine's time over the measurement, so every
    decode step sharing a step with them waited that much longer; high from ``client_lag_share_most``."""

    min_num_spikes: int = 3
    """Interactivity: fewer stalls than this are noise."""

    long_prompt_ratio: float = 4.0
    """Long/short: a prompt at least this multiple of the median prompt length counts as long."""

    short_ttft_inflation: float = 2.0
    """Long/short: short requests' median TTFT while a long prefill runs / without one, at or above
    which long prompts block short ones (head-of-line blocking)."""

    min_group_size: int = 3
    """Comparisons of two request groups need at least this many requests in each."""

    prefix_hit_share_of_expected: float = 0.5
    """Prefix-cache misses: measured hit rate below this fraction of the hit rate the traffic's shared
    prefixes allow."""

    min_expected_hit_rate: float = 0.2
    """Prefix-cache misses: traffic whose shared prefixes could save less than this is not worth a
    finding."""

    network_min_ms: float = 30.0
    """Network overhead: median client TTFT minus server TTFT below this is normal transport."""

    network_share_of_ttft: float = 0.3
    """Network overhead: that gap / client TTFT at or above which a proxy or gateway dominates."""

    batch_wait_steps: float = 2.0
    """Static batching seen in requests' own times (rules/prompt_gap.py): a loaded run's requests waited at least
    this many decode steps (median TPOT) beyond the path's cost before their prompt ran, on average. A continuously
    batching server adds a new request to its next step: under one step (docs/doctor.md, "llama-server's prompt
    time per request")."""

    batch_wait_share: float = 0.3
    """Static batching seen in requests' own times: high when that wait is at least this share of the mean TTFT."""

    batch_wait_min_share: float = 0.1
    """Static batching seen in requests' own times: no finding under this share of the mean TTFT (behind a slow hop
    the gap's jitter alone is a few steps, but a few percent of the TTFT)."""

    max_client_lag_ms: float = 10.0
    """Client limits: p99 dispatch or event-loop lag of the load generator above this taints latencies
    (same default as ``kvpilot bench --max-client-lag-ms``)."""

    spillover_roofline_efficiency: float = 0.2
    """Memory spillover: decode speed below this fraction of the roofline, together with swap or host
    KV use, means memory spilled to a slower tier."""

    process_swap_share: float = 0.05
    """Memory spillover: share of the server process's own memory (resident + swapped) that is swapped
    out at or above which the server itself has spilled (``kvpilot:process_swap_bytes``). A few
    percent of cold pages (import-time objects, the loader's buffers) swapped out of a long-running
    process is normal housekeeping; the weights and KV blocks are most of a serving process."""

    spill_major_faults_per_token: float = 1.0
    """Memory spillover: major page faults of the server process per generated token at or above
    which its swapped pages sit on the decode path (every step reads some back from disk). A loaded,
    healthy server takes none while generating."""

    min_requests: int = 5
    """Rules drawing statistics over requests need at least this many successful ones."""

    client_lag_share_of_latency: float = 0.1
    """Client limits: the client's p99 lag must also be at least this share of the run's median TTFT (the
    latency a stall shifts by its whole length) to taint what it measured: a 14 ms stall next to a 1,400 ms
    TTFT changes nothing anyone reads."""

    client_stall_duty: float = 0.2
    """Client limits: the load generator's event loop was stalled at least this share of a run's time (its
    loop-lag samples: late time over elapsed time). Stalls that often land in most requests, several per
    slow request, so a client-side gap many times one stall is still the client's (a network hop stalls no loop).
    """

    client_lag_share_most: float = 0.5
    """Client limits: the lag explains "most of the time" at or above this share of a delay. Against its
    run's median TTFT it makes client-overload high; against the delay the other findings diagnose (their
    measured milliseconds, else the highest load's median TTFT) it keeps client-overload a finding rather
    than a caveat (kvpilot.doctor.attribution). Half, so that a cause ranked first explains more of the
    time than the client could: a 20 ms stall is a caveat beside a 3 s queue wait."""

    client_tail_share: float = 0.25
    """Client limits, beside a healthy server (no other finding above low): a co-located client whose own
    delay is at least this share of its slowest requests' TTFT (p90 of client minus server TTFT against p90
    client TTFT), and that its stalls account for, is a medium finding rather than a caveat: the one delay
    measured that nothing on the server explains (a client stalling once a second that delays a fifth of its
    first tokens: tests/doctor/test_matrix_misses.py)."""

    min_client_tail_ms: float = 20.0
    """Client limits: that client-side p90 gap below this is never a finding (a loopback hop and a busy
    loop's few milliseconds)."""

    min_max_len_requests: float = 4.0
    """KV pool size: a pool holding fewer than this many ``max_model_len`` requests at once is a
    finding (medium); a few long requests then take the whole pool and everything else waits."""

    max_len_requests_high: float = 2.0
    """KV pool size: below this many ``max_model_len`` requests (one long request blocks all the
    others) the finding is high severity."""

    seqs_over_kv_ratio: float = 2.0
    """Sequence cap vs KV: ``max_num_seqs`` at or above this multiple of the requests the pool holds at
    the observed request size admits sequences that must then be preempted."""

    cpu_wait_share: float = 0.2
    """CPU starvation: share of the server threads' runnable time spent waiting for a CPU (kernel
    run-queue delay) at or above which the server is starved (medium); a server alone on its cores
    waits a few percent."""

    cpu_wait_share_high: float = 0.4
    """CPU starvation: at or above this run-queue share the finding is high and step-time findings
    (decode, prefill, stalls) defer to it: every step waited that long for a CPU."""

    min_other_cores: float = 0.5
    """CPU starvation: cores the rest of the host must use for the wait to be blamed on other
    processes (below it the server's own threads oversubscribe the cores)."""

    steal_share: float = 0.1
    """CPU starvation: share of host CPU time stolen by the hypervisor at or above which the VM does
    not get the CPUs it was sold."""

    single_step_delay_steps: float = 1.5
    """Long/short mixing: a short request's extra TTFT during a long prefill of at most this many
    long-prefill steps is the step the long prompt was computed in: inherent to the hardware when the
    chunking fix cannot split that prompt (a headroom note, not a finding)."""

    prefix_spread_high: float = 1.5
    """Prefix-blind routing: mean number of distinct replicas that served each prefix group (bench's
    ``prefix_spread``) above which routing ignores prefixes. 1.0 is perfect affinity; round-robin over R
    replicas gives about min(R, requests per group), so with two replicas a blind router lands near 2."""

    routing_hit_share_of_offered: float = 0.7
    """Prefix-blind routing: the replicas' combined prefix-cache hit rate below this share of the reuse the
    traffic offers (bench's ``offered_reuse``) is worth routing by prefix: more than 30% of the reusable
    prefill is recomputed. Blind routing with a cache large enough for every prefix on every replica only
    repeats each group's first miss once per replica (4 groups of 8 on 2 replicas: 86% of offered), which
    stays quiet."""

    replica_imbalance_high: float = 1.5
    """Replica imbalance: max / mean requests served per replica of one lane at or above which one replica
    carries half again its share (round-robin gives 1.0; random placement of 20+ requests per replica rarely
    passes 1.3)."""

    own_best_window_ratio: float = 3.0
    """Degraded run: the run's typical window (median output throughput of its windows at its typical load,
    kvpilot.doctor.windows) at or below its best window / this ratio means the server ran far below the speed
    it showed in the same run, at the same load, for most of it. A steady server's windows lie within about
    1.3x of each other; the configuration is the same in every window, so a several-fold swing is the host."""

    min_best_window_tokens: float = 20.0
    """Degraded run: the best window must have delivered at least this many tokens to be a speed the machine
    reached (fewer are a few chunks, whose timing is noise)."""

    far_below_roofline: float = 0.05
    """Degraded run: even the run's fastest requests (p10 TPOT) decoding at less than this share of the
    roofline's step time at that batch means the machine was not giving the server its own speed. The slowest
    healthy kvpilot path on a CPU, float32 compute over packed GGUF weights, decodes the embedded model in about
    17 ms a token against fit's 3.9 ms floor (23%); bfloat16 comes close to the floor. A twentieth leaves that
    path a 4-5x margin for a busy host and catalog figures. The served roofline (kvpilot's capacity endpoint) is
    judged this way only on a CPU, where small models reach it (on a GPU a small model's step is per-step
    overhead, far above the bandwidth floor)."""

    speculation_net_loss: float = 0.05
    """Speculation costs: speculating requests at the measured load making at least this share fewer tokens
    per unit of step time than plain decoding would (the engine's cost model, docs/doctor.md): a few percent is
    within the model's error; more is a setting to change."""

    copy_share_min: float = 0.3
    """Prompt copying: at least this share of the output words continue a span of the prompt (bench's
    ``num_copied_words``) before n-gram speculation is worth suggesting. A chat answer copies a few percent
    (quoted names, a restated question); an edit or a summary with quotes copies half or more."""

    copy_max_in_flight: float = 2.0
    """Prompt copying: the lowest load measured must have at most this many requests in flight, where a decode
    step reads the weights for one or two rows and drafts ride along almost free (memory-bound decode)."""
