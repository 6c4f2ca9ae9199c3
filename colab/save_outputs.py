"""Runs a notebook's code cells in order, in one namespace, and saves what each printed
and drew into the notebook, so a reader sees the results without running it:

    python colab/save_outputs.py colab/quickstart.ipynb

Standard output becomes a cell's `stream` output and each figure left open at the end
of a cell an `image/png` one (as Colab shows them inline); the figures are then closed.
Needs no Jupyter: the notebooks are plain Python cells.
"""

import base64
import contextlib
import io
import json
import os
import sys


def run(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        nb = json.load(f)
    namespace = {"__name__": "__main__"}
    count = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile("".join(cell["source"]), f"{path}[{count}]", "exec"), namespace)
        outputs = []
        if out.getvalue():
            outputs.append({"output_type": "stream", "name": "stdout",
                            "text": out.getvalue().splitlines(keepends=True)})
        for number in plt.get_fignums():
            png = io.BytesIO()
            plt.figure(number).savefig(png, format="png", dpi=80, bbox_inches="tight")
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"image/png": base64.b64encode(png.getvalue()).decode(),
                                     "text/plain": ["<Figure>"]}})
        plt.close("all")
        cell["outputs"], cell["execution_count"] = outputs, count
        sys.stderr.write(f"cell {count}: {len(outputs)} outputs\n")
    with open(path + ".tmp", "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    for notebook in sys.argv[1:]:
        run(notebook)
