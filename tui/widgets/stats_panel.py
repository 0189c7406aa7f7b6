"""The live figures beside the chat: how well speculation works right now, and where it runs."""

from __future__ import annotations

from collections import deque

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Sparkline, Static

from swiftspec.engine.config import Device
from swiftspec.engine.events import StepStats
from swiftspec.engine.host.protocol import EngineInfo, RankInfo

SPARK_STEPS = 60  # recent steps drawn in the latency sparkline


def _grid(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def _threads(info: EngineInfo, rank: RankInfo) -> str:
    """A CPU rank's threads: a target's kernel threads by mode (profiling chose them), else its own."""
    by_mode = info.kernel_threads if rank.role == "target" else {}
    if not by_mode:
        return f"{rank.torch_threads} thread{'s' if rank.torch_threads != 1 else ''}"
    if len(set(by_mode.values())) == 1:
        return f"kernels on {next(iter(by_mode.values()))} threads"
    return "kernel threads " + info.kernel_threads_by_mode()


def _layout_text(info: EngineInfo) -> Table:
    """One row per group, e.g. 'target r0 cuda:0, r1 cuda:1', then the models: the target with its
    precision, and the draft. Each value wraps under itself, never cut, in a panel as wide as the terminal
    allows."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for role in ("target", "draft"):
        members = [r for r in info.ranks if r.role == role]
        if members:
            where = ", ".join(f"r{r.rank} {r.device}" + (f" · {_threads(info, r)}" if r.device == Device.CPU else "")
                              for r in members)
            grid.add_row(Text(role, style=f"bold {'green' if role == 'target' else 'cyan'}"), where)
    grid.add_row(Text("model", style="dim"), info.target)
    grid.add_row(Text("draft", style="dim"), info.draft)
    return grid


class StatsPanel(VerticalScroll, can_focus=False):
    """Shows the latest StepStats; the app feeds it from its flush timer, a batch of steps at a time."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Live stats"
        self._recent: deque[float] = deque(maxlen=SPARK_STEPS)  # per-token latency of recent steps
        self._stats = StepStats()
        self._mode = ""
        self._d_configured = ""  # d as the workers chose it at start, e.g. "4 auto"

    def compose(self) -> ComposeResult:
        yield Static(id="figures")
        yield Sparkline([], id="latency-spark")
        yield Static(id="steps")
        yield Label("Layout", classes="section")
        yield Static(id="layout")

    def on_mount(self) -> None:
        self._refresh_figures()

    def set_info(self, info: EngineInfo) -> None:
        """Models, ranks, tree policy."""
        self._d_configured = f"{info.d} auto" if info.d_auto else str(info.d)
        self.query_one("#layout", Static).update(_layout_text(info))
        self._refresh_figures()

    def start_turn(self, mode: str) -> None:
        self._mode = mode
        self._stats = StepStats()
        self._refresh_figures()

    def add_steps(self, steps: list[tuple[StepStats, int]]) -> None:
        """Takes the (stats, tokens produced) of the steps since the last refresh."""
        for stats, tokens in steps:
            self._stats = stats
            if tokens:
                self._recent.append(stats.token_latency_ms)
        self.query_one(Sparkline).data = list(self._recent)
        self._refresh_figures()

    def _refresh_figures(self) -> None:
        s = self._stats
        speculative = self._mode != "ar"
        p50 = s.ms_per_token_p50
        dash = "–"
        self.query_one("#figures", Static).update(_grid([
            ("mode", self._mode or dash),
            ("acceptance", f"{100 * s.acceptance_rate:.1f} %" if speculative and s.generated else dash),
            ("tok/verify", f"{s.mean_accepted:.2f}" if speculative and s.generated else dash),
            ("tokens/s", f"{s.tokens_per_s:.1f}" if s.generated else dash),
            ("latency now", f"{s.token_latency_ms:.1f} ms" if s.generated else dash),
            ("latency p50", f"{p50:.1f} ms" if s.generated else dash),
        ]))
        d = str(s.d) if s.d else self._d_configured
        self.query_one("#steps", Static).update(_grid([
            ("tree size", str(s.tree_size) if speculative and s.generated else dash),
            ("draft step", f"{s.draft_ms:.1f} ms" if speculative and s.generated else dash),
            ("target step", f"{s.target_ms:.1f} ms" if s.generated else dash),
            ("d", d or dash),
            ("tokens", str(s.generated) if s.generated else dash),
            ("prefilled", str(s.prefill_tokens) if s.generated else dash),
        ]))
