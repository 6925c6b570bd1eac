"""Take the README's picture: TensorBoard comparing a linear=torch and a linear=custom run, in headless Chromium.

    python docs/screenshot.py                      # trains both runs (digits, ~1 min) into a temporary folder
    python docs/screenshot.py --logdir outputs     # or shows runs you already have
    python docs/screenshot.py --all                # also Scalars, Custom Scalars and HParams, as a user sees them

Needs Chromium (Debian: `apt-get install chromium`) and Playwright (`pip install -r docs/requirements.txt`),
which drives it: it waits until the charts are drawn, where Chromium's own --screenshot often caught the page
before its cards had rendered. Writes docs/tensorboard.png.
"""
import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Chromium as root, offline: no sandbox, and none of the background connections a closed network refuses.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Each picture: the dashboard's address, and a text on it that says its data has arrived. The README's shows
# both runs' epoch times, custom's speedup epoch by epoch (where epochs are long enough to time: not on digits)
# and the validation curves, unsmoothed.
VIEWS = {
    "tensorboard.png": ("?tagFilter=%5E%28val%2Facc%7Cval%2Floss%7Ctime%2Fepoch_s%7Ctime%2Fstep_speedup%29%24&smoothing=0#timeseries", "text=time/epoch_s"),
    "tensorboard_scalars.png": ("#scalars", "text=time"),
    "tensorboard_custom_scalars.png": ("#custom_scalars", "text=torch vs custom"),
    "tensorboard_hparams.png": ("#hparams", "text=Trial ID"),
}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_both(folder):
    """The README's comparison, `python train.py -m linear=torch,custom`, run in `folder`: its sweep is in
    `folder`/outputs/multirun/<date>/<time>, its runs named as a user's are."""
    subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "linear=torch,custom"], cwd=folder, check=True)


def wait_for(url, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: TensorBoard did not answer at {url} within {timeout_s} s")
            time.sleep(0.5)


def take_pictures(chromium, url, size, pictures):
    """Each of `pictures` ({file: (address, text to wait for)}) of the TensorBoard at `url`."""
    from playwright.sync_api import sync_playwright  # only this script needs it

    width, height = (int(pixels) for pixels in size.split(","))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        for out, (address, ready) in pictures.items():
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url + address, wait_until="networkidle")
            page.wait_for_selector(ready)
            close = page.get_by_label("Close side pane")
            if close.count():
                close.click()  # the settings pane would take a fifth of the width
            page.wait_for_timeout(3000)  # the charts draw after their data arrives
            page.screenshot(path=out)
            page.close()
            print(f"wrote {out}")
        browser.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, help="runs to show (default: train both linears now)")
    parser.add_argument("--size", default="1600,1000", help="window width,height in pixels")
    parser.add_argument("--all", action="store_true", help="every dashboard, not only the README's picture")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        raise SystemExit("error: no Chromium on PATH; install it (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as scratch:
        logdir = args.logdir
        if logdir is None:
            train_both(scratch)
            (logdir,) = Path(scratch, "outputs", "multirun").glob("*/*")  # one sweep: its runs' names stay short
        port = free_port()
        board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                  "--host", "127.0.0.1", "--port", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_for(url)
            names = list(VIEWS) if args.all else ["tensorboard.png"]
            take_pictures(chromium, url, args.size, {REPO / "docs" / name: VIEWS[name] for name in names})
        finally:
            board.terminate()
            board.wait()


if __name__ == "__main__":
    main()
