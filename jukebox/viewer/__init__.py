"""`jukebox view TAPE`: a tape in the browser (docs/viewer.md).

`model` turns a loaded tape into plain JSON (a compact index of every frame, the run's facts,
one frame in full on demand, a comparison with a fork); `page` builds the page from the
assets shipped in `assets/` (inline, no network); `server` serves it on loopback with one JSON
endpoint per frame. Everything a tape holds is someone else's text: the page puts it in the
document as text only (never as markup), under a Content-Security-Policy that runs no script
but the page's own.
"""
