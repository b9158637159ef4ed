"""The report's inline stylesheet (no web fonts, no external files)."""

CSS = """
:root { --fg:#1d2330; --muted:#5f6b7a; --line:#dde2e8; --bg:#f6f7f9; --card:#fff;
  --pass:#1a7f37; --fail:#b35900; --limit:#6e56cf; --infra:#c62828; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1260px; padding: 18px 22px 40px; background: var(--bg); color: var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 22px; margin: 0 0 2px; } h2 { font-size: 17px; margin: 0 0 10px; }
code, pre, .path { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.sub { color: var(--muted); margin: 0 0 14px; } .path { font-size: 12px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px;
  margin: 0 0 14px; }
section.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(130px, 1fr)); gap: 10px;
  background: none; border: 0; padding: 0; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 8px 12px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.card .v { font-size: 20px; font-weight: 600; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; }
table.kv { display: inline-table; margin: 0 8px 6px 0; }
table.kv th { text-align: left; color: var(--muted); font-weight: 500; padding: 2px 14px 2px 0; vertical-align: top; }
table.kv td { padding: 2px 0; font-variant-numeric: tabular-nums; word-break: break-word; }
.kvgrid { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 2px 18px; margin-bottom: 6px; }
.kvgrid div { display: flex; justify-content: space-between; gap: 10px; border-bottom: 1px dotted #e3e6ea; padding: 2px 0; }
.kvgrid .k { color: var(--muted); } .kvgrid .v { font-variant-numeric: tabular-nums; text-align: right; word-break: break-all; }
table.data { width: 100%; font-size: 12.5px; font-variant-numeric: tabular-nums; }
table.data th { position: sticky; top: 0; background: #eef1f4; text-align: right; padding: 4px 8px;
  border-bottom: 1px solid var(--line); white-space: nowrap; }
table.data td { text-align: right; padding: 3px 8px; border-bottom: 1px solid #eef0f3; }
table.data tr:hover td { background: #f3f6fa; }
.scroll { overflow: auto; } .scroll.tall { max-height: 420px; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 8px; }
svg { font-family: inherit; } svg.chart { height: auto; display: block; } svg .ctitle { font-size: 13px; font-weight: 600; fill: var(--fg); }
svg .frame { fill: #fbfcfd; stroke: var(--line); } svg .grid { stroke: #e8ebef; }
svg .axis { stroke: #9aa4b0; } svg .tick { font-size: 10.5px; fill: var(--muted); }
svg .alabel { font-size: 11px; fill: var(--muted); } svg .legend { font-size: 11px; fill: var(--fg); }
svg .empty { fill: var(--muted); font-size: 13px; }
svg .legendnum { font-size: 10px; fill: #fff; paint-order: stroke; stroke: rgba(0,0,0,.45); stroke-width: 2px; }
svg .lanelabel { font-size: 11px; font-family: ui-monospace, Menlo, Consolas, monospace; }
svg .lanelabel.pass { fill: var(--pass); } svg .lanelabel.fail { fill: var(--fail); }
svg .lanelabel.limit { fill: var(--limit); } svg .lanelabel.infra { fill: var(--infra); }
.stack { display: flex; height: 18px; border-radius: 4px; overflow: hidden; border: 1px solid var(--line); }
.obar.ok { background: #4c9be8; } .obar.limit { background: var(--limit); } .obar.infra { background: var(--infra); }
.obar + .obar { border-left: 1px solid #fff; }
.small { color: var(--muted); font-size: 12.5px; margin: 6px 0; } .warn { color: var(--infra); }
.tag { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.row { display: grid; grid-template-columns: minmax(160px, 2.2fr) 1.6fr .7fr .6fr 1.3fr .8fr 1fr; gap: 8px;
  padding: 4px 6px; align-items: center; }
.row span { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.row.head { font-weight: 600; color: var(--muted); font-size: 12px; border-bottom: 1px solid var(--line); }
.num { text-align: right; font-variant-numeric: tabular-nums; }
details.ep { border-bottom: 1px solid #eef0f3; }
details.ep > summary { cursor: pointer; list-style: none; }
details.ep > summary::-webkit-details-marker { display: none; }
details.ep > summary:hover { background: #f3f6fa; }
details.ep[open] > summary { background: #eef3fb; }
details.ep .body { padding: 8px 10px 12px; }
.badge { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px; color: #fff; }
.badge.pass { background: var(--pass); } .badge.fail { background: var(--fail); }
.badge.limit { background: var(--limit); } .badge.infra { background: var(--infra); }
.badge.eval { background: #55606e; }
.chip { display: inline-block; margin: 1px 2px; padding: 0 5px; border-radius: 3px; font-size: 11px;
  font-family: ui-monospace, Menlo, Consolas, monospace; }
pre { background: #f3f4f6; border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; overflow: auto;
  max-height: 480px; white-space: pre-wrap; word-break: break-word; font-size: 12px; }
footer { color: var(--muted); font-size: 12px; text-align: center; margin-top: 20px; }
"""
