"""Take the README's picture: TensorBoard comparing a linear=torch and a linear=custom run, in headless Chromium.

    python docs/screenshot.py                      # trains both runs (digits, ~1 min) into a temporary folder
    python docs/screenshot.py --logdir outputs     # or shows runs you already have

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
PICTURE = REPO / "docs" / "tensorboard.png"
# Chromium as root, offline: no sandbox, and none of the background connections a closed network refuses.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# What the picture shows: the validation curves and the epoch times of both runs, unsmoothed.
VIEW = "?tagFilter=val%2F%7Ctime%2F&smoothing=0#timeseries"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_both(folder):
    """The README's comparison, `python train.py -m linear=torch,custom`, run in `folder`: its runs are in
    `folder`/outputs, named as a user's are."""
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


def take_picture(chromium, url, size, out):
    from playwright.sync_api import sync_playwright  # only this script needs it

    width, height = (int(pixels) for pixels in size.split(","))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(url, wait_until="networkidle")
        page.wait_for_selector("text=val/acc")
        page.get_by_label("Close side pane").click()  # the settings pane would take a fifth of the width
        page.wait_for_timeout(3000)  # the charts draw after their data arrives
        page.screenshot(path=out)
        browser.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, help="runs to show (default: train both linears now)")
    parser.add_argument("--size", default="1600,1000", help="window width,height in pixels")
    parser.add_argument("--out", type=Path, default=PICTURE)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        raise SystemExit("error: no Chromium on PATH; install it (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as scratch:
        logdir = args.logdir
        if logdir is None:
            train_both(scratch)
            logdir = Path(scratch) / "outputs"
        port = free_port()
        board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                  "--host", "127.0.0.1", "--port", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_for(url)
            take_picture(chromium, url + VIEW, args.size, args.out)
        finally:
            board.terminate()
            board.wait()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
