"""The service's Prometheus metrics (on `serve.metrics.Registry`): queue and job gauges read at scrape time,
songs, tokens, stage seconds, fallbacks, retries, purges, HTTP responses and replicas."""
from __future__ import annotations

from ..protocol import PHASES
from .metrics import RateWindow, Registry
from .worker import ENGINE_DOWN


class ServiceMetrics:
    """The metrics (part of `SongService`)."""

    def _init_metrics(self) -> None:
        registry = self.metrics = Registry()
        registry.gauge("yue2_queue_depth", "Jobs queued and not yet started.", function=lambda: self.store.queued())
        registry.gauge("yue2_songs_in_flight", "Songs the scheduler is running now.", function=self.in_flight)
        registry.gauge("yue2_jobs", "Jobs in the store by status.", ("status",),
                       function=lambda: {(k,): v for k, v in self.store.counts().items()})
        self.songs_finished = registry.counter("yue2_songs_finished_total",
                                               "Songs that reached a final status since start.", ("status",))
        self.tokens_total = registry.counter("yue2_ar_tokens_total", "AR tokens generated, by phase.", ("phase",))
        self.token_rate = RateWindow(10)
        registry.gauge("yue2_ar_tokens_per_second", "AR tokens per second over the last 10 s, by phase.",
                       ("phase",), function=lambda: self.token_rate.rates(PHASES))
        self.nar_seconds = registry.histogram("yue2_nar_seconds", "NAR (flow matching) seconds per song.")
        self.vae_seconds = registry.histogram("yue2_vae_seconds", "VAE decode seconds per song.")
        self.song_seconds = registry.histogram("yue2_song_seconds", "Seconds from acceptance to complete.")
        self.fallbacks = registry.counter("yue2_fallbacks_total", "AR phases served by the torch backend instead "
                                          "of the requested one, by phase and reason.", ("phase", "reason"))
        self.engine_retried = registry.counter("yue2_engine_retries_total",
                                               "Songs put back in the queue after an engine failure.")
        self.replica_retried = registry.counter("yue2_replica_retries_total",
                                                "Songs put back in the queue after the replica running them died.")
        self.purged = registry.counter("yue2_jobs_purged_total", "Jobs removed (DELETE or retention).")
        registry.gauge("yue2_engine_up", "1 while the AR engine can serve (or none is needed).",
                       function=lambda: 0 if self.engine_status()["state"] in ENGINE_DOWN + ("start_failed",) else 1)
        registry.counter("yue2_engine_restarts_total", "Times the AR engine worker was restarted (all replicas).",
                         function=lambda: self.engine_status().get("restarts", 0))
        self.http_responses = registry.counter("yue2_http_responses_total", "HTTP responses by status code.",
                                               ("code",))
        registry.gauge("yue2_replicas", "Song-worker replicas (serve --replicas / --ray-address): serving and wanted.",
                       ("state",), function=self._replica_counts)
        registry.gauge("yue2_replica_songs_in_flight", "Songs each serving replica runs now.", ("replica",),
                       function=lambda: {(r["replica"],): r["in_flight"] or 0
                                         for r in self.workers.health().get("replica_states", ())})

    def _replica_counts(self) -> dict:
        replicas = self.workers.health().get("replicas")  # "serving/wanted"; none in a single process
        if not replicas:
            return {}
        serving, wanted = replicas.split("/")
        return {("serving",): int(serving), ("wanted",): int(wanted)}
