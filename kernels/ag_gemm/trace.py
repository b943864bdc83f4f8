"""Per-program trace events of a traced call, as a table (for timelines)."""
from __future__ import annotations

KINDS = {1: "publish", 2: "fetch", 3: "wait", 4: "compute"}


def frame(raw, rank: int = 0, fetchers: int | None = None):
    """pandas DataFrame of a call's events: program, role, kind, item, start, end, sm, rank.

    ``raw`` is the (programs, events, 5) tensor a traced call returned. Times are
    nanoseconds of the GPU's global timer (an event counter in a simulated world),
    shifted so the call's first event starts at 0.
    """
    import pandas as pd

    t = raw.detach().to("cpu")
    rows = []
    for prog in range(t.shape[0]):
        for kind, item, t0, t1, sm in t[prog].tolist():
            if kind == 0:
                break
            rows.append({"program": prog, "kind": KINDS.get(kind, str(kind)), "item": item, "start": t0, "end": t1,
                         "sm": sm, "rank": rank})
    df = pd.DataFrame(rows, columns=["program", "kind", "item", "start", "end", "sm", "rank"])
    if len(df):
        t_min = df["start"].min()
        df["start"] -= t_min
        df["end"] -= t_min
    if fetchers is not None:
        df["role"] = ["fetcher" if p < fetchers else "gemm" for p in df["program"]]
    return df
