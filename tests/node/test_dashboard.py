"""The admin dashboard page, rendered by a real browser (Debian's headless Chromium)."""

from kvpool import Client, Namespace
from tests.browser import chromium
from tests.helpers import content


def render(url: str) -> str:
    return chromium("--dump-dom", url)


def test_dashboard_shows_the_node_live(node):
    ns = Namespace(model="dash-model", dtype="bfloat16")
    with Client(node.unix_address) as client:
        client.describe(ns)
        keys = ns.keys([bytes([i]) * 32 for i in range(7)])
        client.put(keys, [content(k, 10_000) for k in keys])
        client.lookup([*keys, ns.key(b"absent" * 6)])
    dom = render(node.admin_url + "/")
    assert '<span id="node">node</span>' in dom  # filled in by the page's script
    assert "dash-model bfloat16" in dom
    assert "<th>blocks</th><td>7</td>" in dom
    assert "87.5%" in dom  # 7 of 8 looked-up blocks hit
    assert '<tr class="tier-dram"><td>dram</td><td>64.0 MiB</td>' in dom  # the tiers table
    assert '<div id="error"></div>' in dom  # no fetch error shown


def test_a_namespace_label_is_shown_as_text_never_run(node):
    """Stored XSS, from the attacker's side: a tenant DESCRIBEs a namespace whose label is
    markup with a script in it; the operator's dashboard shows the label as text, and no
    element of it is ever created (so nothing of it runs with the operator's credentials)."""
    attack = "<img src=x onerror=\"document.title='pwned'\"><b>bold</b>"
    ns = Namespace(model=attack)
    with Client(node.unix_address) as client:
        client.describe(ns)
        key = ns.key(b"k" * 32)
        client.put([key], [content(key, 1000)])
    dom = render(node.admin_url + "/")
    assert "&lt;img src=x onerror=" in dom  # the label, as text
    assert "<img" not in dom and "<b>bold</b>" not in dom
    assert "pwned" not in dom.split("<body", 1)[0]  # the title is the page's own
    assert '<div id="error"></div>' in dom
