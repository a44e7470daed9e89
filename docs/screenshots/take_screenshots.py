"""Take docs/screenshots/*.png in a real JupyterLab, driven in headless Chromium over the DevTools protocol.

How they were taken (issue 36), from a scratch folder holding a copy of notebooks/ (running cells
there touches no tracked file):

    apt-get install -y chromium
    PYTHONPATH=<repo> jupyter lab --no-browser --port 8899 --ip 127.0.0.1 --ServerApp.token=tok36 \
        --ServerApp.root_dir=<scratch> --LabApp.expose_app_in_browser=True --LabApp.news_url=None
    chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
        --user-data-dir=<empty dir> --remote-debugging-port=9333 about:blank
    python take_screenshots.py <out dir>

(As root, jupyter lab also needs --allow-root.)

It opens 01, shows the first "predict, then run" cell with its output hidden, runs it, types a
typical first wrong answer into the exercise's cell (scaffold and check share it; NumPy's raw state
kept) and runs it. Cells are found by their source, not their index, so moving cells does not break
it. It needs websocket-client and Pillow; images are saved at 1400x1000 and reduced to 96 colours
for the repository. `python take_screenshots.py <out dir> capstone` takes only 05's capstone plot:
it runs 05's first cell and the capstone cell (a child process SIGKILLed, a fresh one resuming),
then shows the plot.
"""
import base64, json, sys, time, urllib.request
import websocket
from PIL import Image

PORT_LAB, PORT_CDP, TOKEN = 8899, 9333, "tok36"
OUT = sys.argv[1]

def cdp_page():
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORT_CDP}/json"))
    page = next(t for t in targets if t["type"] == "page")
    return websocket.create_connection(page["webSocketDebuggerUrl"], timeout=120)

ws = cdp_page()
_id = [0]
def call(method, **params):
    _id[0] += 1
    ws.send(json.dumps({"id": _id[0], "method": method, "params": params}))
    while True:
        msg = json.loads(ws.recv())
        if msg.get("id") == _id[0]:
            if "error" in msg:
                raise RuntimeError(msg["error"])
            return msg.get("result", {})

def js(expr, await_promise=True):
    r = call("Runtime.evaluate", expression=expr, awaitPromise=await_promise, returnByValue=True)
    if "exceptionDetails" in r:
        raise RuntimeError(r["exceptionDetails"])
    return r["result"].get("value")

def wait_for(expr, timeout=180):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if js(expr):
                return
        except RuntimeError:
            pass
        time.sleep(0.5)
    raise TimeoutError(expr)

def shot(name):
    time.sleep(1.0)
    data = call("Page.captureScreenshot", format="png")["data"]
    path = f"{OUT}/{name}.png"
    open(path, "wb").write(base64.b64decode(data))
    Image.open(path).convert("RGB").quantize(96).save(path, optimize=True)  # ~80 KB instead of ~200
    print("saved", name)

call("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1, mobile=False)
call("Emulation.setFocusEmulationEnabled", enabled=True)  # headless has no focused window: JupyterLab tracks focus

PANEL = "[...jupyterapp.shell.widgets('main')].find(w => w.content && w.content.widgets)"


def open_notebook(path):
    call("Page.navigate", url=f"http://127.0.0.1:{PORT_LAB}/lab/tree/{path}?reset&token={TOKEN}")
    wait_for("!!(window.jupyterapp && [...jupyterapp.shell.widgets('main')].some(w => w.content && w.content.widgets && w.content.widgets.length > 3))")
    js(f"(() => {{ const w = {PANEL}; jupyterapp.shell.activateById(w.id); w.content.node.focus(); return true }})()")
    wait_for(f"{PANEL}.sessionContext.session && {PANEL}.sessionContext.session.kernel"
             f" && {PANEL}.sessionContext.session.kernel.status === 'idle'")
    # close the news / notification toasts if any
    js("document.querySelectorAll('.jp-Notification-Toast-Close, .Toastify__close-button').forEach(b => b.click()); true")

NB = PANEL + ".content"

def show(i, top=True):
    js(f"{NB}.activeCellIndex = {i}; {NB}.widgets[{i}].node.scrollIntoView({{block: '{'start' if top else 'center'}'}}); true")

async_run = """(async () => {{
  const nb = {NB};
  nb.activeCellIndex = {i};
  nb.widgets[{i}].node.scrollIntoView({{block: 'start'}});
  await jupyterapp.commands.execute('notebook:run-cell');
  const ctx = {PANEL}.sessionContext;
  for (let k = 0; k < 600; k++) {{
    await new Promise(r => setTimeout(r, 200));
    if (ctx.session.kernel.status === 'idle' && nb.widgets[{i}].model.executionCount !== null) return true;
  }}
  return false;
}})()"""

def run(i):
    ok = js(async_run.format(NB=NB, i=i, PANEL=PANEL))
    time.sleep(0.5)
    return ok

def set_source(i, text):
    js(f"{NB}.widgets[{i}].model.sharedModel.setSource({json.dumps(text)}); true")

def hidden(i):
    return js(f"{NB}.widgets[{i}].outputHidden")

def find(text):
    """The index of the first cell whose source contains `text`."""
    i = js(f"{NB}.widgets.findIndex(w => w.model.sharedModel.getSource().includes({json.dumps(text)}))")
    if i < 0:
        raise LookupError(f"no cell contains {text!r}")
    return i

def capstone():
    """05's capstone: run the setup cell and the capstone cell, then show the two-panel plot."""
    open_notebook("notebooks/05_mid_epoch_resume.ipynb")
    i = find("run_capstone(work")
    print("run cell 1:", run(1))
    print("run capstone cell", i, ":", run(i))
    print("capstone output:", js(f"{NB}.widgets[{i}].outputArea.node.innerText")[:400])
    js(f"{NB}.widgets[{i}].outputArea.node.scrollIntoView({{block: 'center'}}); true")
    shot("05-capstone-plot")


if sys.argv[2:] == ["capstone"]:
    capstone()
    sys.exit(0)

# 1. 01: a hidden prediction before and after running it
open_notebook("notebooks/01_rng_capture.ipynb")
p = find("# Predict, then run")
print(f"prediction cell {p} output hidden on open:", hidden(p))
show(p - 1)  # from the markdown above it, which asks for the prediction
shot("01-prediction-hidden-before-run")
print("run cell 1:", run(1))
print(f"run cell {p}:", run(p))
print(f"cell {p} output hidden after run:", hidden(p))
show(p - 1)
shot("01-prediction-shown-after-run")

# 2. 01's first exercise after a wrong answer (NumPy's raw state kept: a typical first try).
# The scaffold and its check share one cell: the answer replaces the scaffold, the check line stays.
e = find("rng_capture.check(")
check_line = js(f"{NB}.widgets[{e}].model.sharedModel.getSource()").splitlines()[-1]
if not check_line.startswith("result = rng_capture.check("):
    raise RuntimeError(f"01's exercise cell {e} no longer ends with its check line: {check_line!r}")
wrong = '''def capture_rng_state():
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # the raw state, an ndarray inside
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": [],
    }


def restore_rng_state(snapshot):
    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch_cpu"])


''' + check_line
set_source(e, wrong)
print(f"run cell {e}:", run(e))
print("verdict text:", js(f"{NB}.widgets[{e}].outputArea.node.innerText")[:600])
show(e)
shot("01-exercise-after-a-wrong-answer")
