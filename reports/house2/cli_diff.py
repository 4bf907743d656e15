"""Issue 36's check of the CLI: every command's options, switches and defaults before and after the refactor.

    python reports/house2/cli_options.py > reports/house2/options_after.json     # in the tree to describe
    python reports/house2/cli_diff.py reports/house2/options_before.json reports/house2/options_after.json

Defaults: before, every option's default was None and the effective default was typed into its help as "[…]";
after, the default is the config field's and the help shows it generated. So the comparison is of option names,
switch forms, required-ness and the bracketed default in the help (normalised: "yes"/"on", "no"/"off", 5e-3/0.005).
"""

import json
import re
import sys

SAME = {"yes": "on", "no": "off", "answer only": "off", "1 MiB": "1048576", "5e-3": "0.005", "all three":
        "xsum,mmlu,sharegpt", "a sweep of seven links": "1,20,5,20,20,20,100,20,1000,20,5,5,100,50"}


def shown(help_text: str | None) -> str | None:
    """The default a help text shows (its last bracket), normalised."""
    found = re.findall(r"\[([^\[\]]*)\]\.?$", help_text or "")
    return SAME.get(found[0], found[0]) if found else None


def main() -> None:
    before, after = (json.load(open(p, encoding="utf-8")) for p in sys.argv[1:3])
    lines, changed = ["# CLI before/after (issue 36)", ""], 0
    for cmd in sorted(set(before) | set(after)):
        a, b = before.get(cmd, {}), after.get(cmd, {})
        rows = []
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                rows.append(f"| `{name}` | {'only after' if name in b else 'only before'} | | |")
                continue
            for key in ("options", "flag", "required"):
                if a[name][key] != b[name][key]:
                    rows.append(f"| `{name}` | {key} | {a[name][key]} | {b[name][key]} |")
            old, new = shown(a[name]["help"]), shown(b[name]["help"])
            if old != new:
                rows.append(f"| `{name}` | default shown | {old or '(none)'} | {new or '(none)'} |")
        changed += len(rows)
        n = len(b)
        lines.append(f"## {cmd or 'edgekv'}: {len(a)} options before, {n} after" + ("" if rows else ", all the same"))
        if rows:
            lines += ["", "| option | what | before | after |", "|---|---|---|---|", *rows]
        lines.append("")
    lines.insert(2, f"{sum(map(len, before.values()))} options before, {sum(map(len, after.values()))} after; "
                    f"{changed} differences.\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
