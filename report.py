"""
What long work shows a person: one progress line (`Progress`: downloads, preparing data,
evaluation, the LR range test) and a line plot written as SVG (`write_svg`: the LR range
test's curve, a sweep's val losses), with nothing but the standard library; and, when a
run asks for one, a Weights & Biases run (`start_wandb`).
"""
import sys
import time


class Progress:
    """One progress line for long work (downloads, preparing data, evaluation):
    rewritten in place on a terminal, a new line every `every` seconds otherwise, so that
    logs stay readable; nothing for work that ends within `delay` seconds. Amounts are in
    `unit`s of `scale` (MB: 1e6)."""

    def __init__(self, what, total=0, unit=' MB', scale=1e6, start=0, delay=2.0,
                 every=10.0):
        self.what, self.total, self.start = what, total, start
        self.unit, self.scale = unit, scale
        self.tty, self.every = sys.stdout.isatty(), every
        self.t0, self.shown, self.delay = time.time(), 0.0, delay

    def __call__(self, done, extra='', last=False):
        now = time.time()
        if now - self.t0 < self.delay:
            return
        if not last and now - self.shown < (0.5 if self.tty else self.every):
            return
        self.shown = now
        rate = (done - self.start) / (now - self.t0)
        f = ',.1f' if self.scale > 1 else ',.0f'
        line = f"{self.what}: {done / self.scale:{f}}"
        if self.total:
            line += f" / {self.total / self.scale:{f}}"
        line += f"{self.unit}{extra}, {rate / self.scale:,.1f}{self.unit}/s"
        if self.total and not last and rate > 0:
            line += f", ETA {(self.total - done) / rate:.0f}s"
        end = '\n' if last or not self.tty else ''
        print(f"\r{line}\033[K" if self.tty else line, end=end, flush=True)


def write_svg(path, curves, title, mark=None, W=560, H=320):
    """A line plot: curves {label: (xs, ys)}, one colour each with its label on the
    right, and a red vertical line at x = mark."""
    xs = [x for cx, _ in curves.values() for x in cx]
    ys = [y for _, cy in curves.values() for y in cy]
    px = lambda x: 50 + (x - min(xs)) / (max(xs) - min(xs) or 1) * (W - 220)
    py = lambda y: H - 30 - (y - min(ys)) / (max(ys) - min(ys) or 1) * (H - 60)
    parts = [f'<text x="50" y="15">{title}</text>']
    for i, (label, (cx, cy)) in enumerate(curves.items()):
        color = ('black', 'blue', 'green', 'orange', 'purple', 'brown', 'gray')[i % 7]
        points = ' '.join(f'{px(x):.1f},{py(y):.1f}' for x, y in zip(cx, cy))
        parts.append(f'<polyline fill="none" stroke="{color}" points="{points}"/>'
                     f'<text x="{W - 160}" y="{30 + 14 * i}" fill="{color}">{label}</text>')
    if mark is not None:
        x = f'{px(mark):.1f}'
        parts.append(f'<line x1="{x}" x2="{x}" y1="20" y2="{H - 30}" stroke="red"/>')
    with open(path, 'w') as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
                'font-size="11"><rect width="100%" height="100%" fill="white"/>'
                + ''.join(parts) + '</svg>')


def start_wandb(project, config):
    """A Weights & Biases run in `project` logging these settings, or None when project
    is ''. wandb is imported only then; without it the run ends in one line."""
    if not project:
        return None
    try:
        import wandb
    except ImportError:
        sys.exit("error: wandb_project needs wandb: pip install wandb")
    wandb.init(project=project, config=config)
    return wandb
