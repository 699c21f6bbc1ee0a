"""Chaos Toolkit probes of llmchaos: thin entry points over `llmchaos.measure`.

    probes.slo          p99_latency_ms, ttft_p99_ms, itl_p99_ms, tpot_p99_ms, goodput_qps,
                        error_rate, frame_drops, achieved_qps,
                        worst_p99_ms_since_fault, sustainable_qps_shortfall,
                        stepped_p99_ms, stepped_error_rate, stepped_unshed_failure_rate
                                                      (client side: the open-loop load)
    probes.target       queue_depth, serving_mode_share, served_in_mode_since_fault,
                        healthy_workers               (target side)
    probes.recovery     recovery_time_s               (waits; its tolerance is the SLA)
    probes.tolerances   at_most, at_least             (tolerances that read configuration)
    probes.prometheus   p99_latency_ms, error_rate, queue_depth, query   (PromQL; no control)

All but probes.prometheus need the `llmchaos.control` control declared in the experiment (it
starts the target and the load they measure).
"""
