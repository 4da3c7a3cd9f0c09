#!/usr/bin/env python3
"""Lists the library's public API, one item per line, and compares it with api/public-api.txt.

    python3 tools/public_api.py            # fails (exit 1) with a diff if the API changed
    python3 tools/public_api.py --write    # writes the new listing after a deliberate change

The API is what a library user reaches: `mmlora` built without default features (no command
line, no bench, no test support). Each line is an item's path and kind, and for a function its
signature, so that a renamed item, a new public field or a changed parameter shows in review as
a diff of the listing. An item reached by several paths (a module's and the crate root's
re-export) is listed in full once, at its shortest path, and the others say which it is. It
reads the JSON that rustdoc writes (tools/rustdoc.py: `--output-format json`, unstable;
`RUSTC_BOOTSTRAP=1` lets the one stable toolchain write it), so it needs no other toolchain and
no other tool.
"""

import argparse
import difflib
import json
import sys
from pathlib import Path

import rustdoc

ROOT = Path(__file__).resolve().parent.parent
LISTING = ROOT / "api" / "public-api.txt"
CRATE = "mmlora"


def rustdoc_json() -> dict:
    """rustdoc's JSON of the library as a user builds it (no default features)."""
    return json.loads(rustdoc.rustdoc([], json_output=True).joinpath(f"{CRATE}.json").read_text())


class Lister:
    """Walks the crate's modules from its root as a user's `use` lines would."""

    def __init__(self, doc: dict):
        self.index = doc["index"]
        self.root = str(doc["root"])
        self.lines: set[str] = set()
        # Each item's id → the paths a user reaches it by.
        self.reached: dict[int, list[str]] = {}

    # Types, as the signature of a function spells them (enough to tell one from another).
    def ty(self, t) -> str:
        if t is None:
            return "()"
        (kind, v), = t.items()
        if kind == "resolved_path":
            args = self.generic_args(v.get("args"))
            return v["path"] + args
        if kind in ("primitive", "generic"):
            return v
        if kind == "borrowed_ref":
            life = f"{v['lifetime']} " if v.get("lifetime") else ""
            mut = "mut " if v.get("is_mutable") else ""
            return f"&{life}{mut}{self.ty(v['type'])}"
        if kind == "raw_pointer":
            return f"*{'mut' if v.get('is_mutable') else 'const'} {self.ty(v['type'])}"
        if kind == "slice":
            return f"[{self.ty(v)}]"
        if kind == "array":
            return f"[{self.ty(v['type'])}; {v['len']}]"
        if kind == "tuple":
            return "(" + ", ".join(self.ty(x) for x in v) + ")"
        if kind == "impl_trait":
            return "impl " + " + ".join(self.bound(b) for b in v)
        if kind == "dyn_trait":
            return "dyn " + " + ".join(
                p["trait"]["path"] + self.generic_args(p["trait"].get("args")) for p in v["traits"]
            )
        if kind == "qualified_path":
            trait = v.get("trait")
            trait = trait["path"] if trait else "?"
            return f"<{self.ty(v['self_type'])} as {trait}>::{v['name']}"
        if kind == "function_pointer":
            sig = v["sig"]
            inputs = ", ".join(self.ty(t) for _, t in sig["inputs"])
            return f"fn({inputs}) -> {self.ty(sig.get('output'))}"
        return kind

    def generic_args(self, args) -> str:
        if not args:
            return ""
        if "angle_bracketed" in args:
            parts = []
            for a in args["angle_bracketed"]["args"]:
                (k, v), = a.items()
                parts.append(self.ty(v) if k == "type" else str(v) if k != "const" else "_")
            for c in args["angle_bracketed"].get("constraints", []):
                binding = c.get("binding", {})
                if "equality" in binding:
                    parts.append(f"{c['name']} = {self.ty(binding['equality'].get('type'))}")
            return "<" + ", ".join(parts) + ">" if parts else ""
        if "parenthesized" in args:
            p = args["parenthesized"]
            out = f" -> {self.ty(p['output'])}" if p.get("output") else ""
            return "(" + ", ".join(self.ty(t) for t in p["inputs"]) + ")" + out
        return ""

    def bound(self, b) -> str:
        if "trait_bound" in b:
            t = b["trait_bound"]["trait"]
            return t["path"] + self.generic_args(t.get("args"))
        return b.get("outlives", "?")

    def signature(self, name: str, f: dict) -> str:
        sig = f["sig"]
        inputs = ", ".join(
            "self" if n == "self" else f"{n}: {self.ty(t)}" for n, t in sig["inputs"]
        )
        header = f.get("header", {})
        prefix = ("const " if header.get("is_const") else "") + (
            "async " if header.get("is_async") else ""
        ) + ("unsafe " if header.get("is_unsafe") else "")
        output = f" -> {self.ty(sig['output'])}" if sig.get("output") else ""
        return f"{prefix}fn {name}({inputs}){output}"

    def add(self, path: str, line: str) -> None:
        self.lines.add(f"{path}: {line}" if line else path)

    def impls(self, path: str, impl_ids: list) -> None:
        traits = []
        for impl_id in impl_ids:
            impl = self.index.get(str(impl_id))
            if impl is None:
                continue
            inner = impl["inner"]["impl"]
            if inner.get("is_synthetic") or inner.get("blanket_impl"):
                continue
            if inner.get("trait"):
                trait = inner["trait"]
                traits.append(trait["path"] + self.generic_args(trait.get("args")))
                continue
            for item_id in inner["items"]:
                self.member(path, self.index[str(item_id)])
        if traits:
            self.add(path, "impl " + ", ".join(sorted(traits)))

    def member(self, path: str, item: dict) -> None:
        if item.get("visibility") != "public":
            return
        (kind, v), = item["inner"].items()
        name = item["name"]
        if kind == "function":
            self.add(f"{path}::{name}", self.signature(name, v))
        elif kind == "assoc_const":
            self.add(f"{path}::{name}", f"const {name}: {self.ty(v['type'])}")
        else:
            self.add(f"{path}::{name}", kind)

    def item(self, path: str, item: dict, seen: frozenset) -> None:
        if item["id"] in seen:
            return
        seen = seen | {item["id"]}
        (kind, v), = item["inner"].items()
        if kind not in ("module", "use"):
            self.reached.setdefault(item["id"], []).append(path)
            return
        if kind == "module":
            self.add(path, "mod")
            for child in v["items"]:
                self.child(path, self.index[str(child)], seen)
        else:
            target = self.index.get(str(v["id"])) if v.get("id") is not None else None
            if v.get("is_glob"):
                if target is not None:
                    for child in target["inner"]["module"]["items"]:
                        self.child(path, self.index[str(child)], seen)
                else:
                    self.add(f"{path}::*", f"pub use {v['source']}::*")
            elif target is not None:
                self.item(path, target, seen)
            else:
                self.add(path, f"pub use {v['source']}")

    def describe(self, path: str, item: dict) -> None:
        """Lists the item at `path`, with its members."""
        (kind, v), = item["inner"].items()
        if kind == "struct":
            self.add(path, "struct")
            fields = v["kind"].get("plain", {}).get("fields", []) if isinstance(v["kind"], dict) else []
            tuple_fields = v["kind"].get("tuple", []) if isinstance(v["kind"], dict) else []
            for field_id in fields + [f for f in tuple_fields if f is not None]:
                field = self.index[str(field_id)]
                if field.get("visibility") == "public":
                    self.add(f"{path}::{field['name']}", f"field {self.ty(field['inner']['struct_field'])}")
            self.impls(path, v["impls"])
        elif kind == "enum":
            self.add(path, "enum")
            for variant_id in v["variants"]:
                variant = self.index[str(variant_id)]
                self.add(f"{path}::{variant['name']}", "variant")
            self.impls(path, v["impls"])
        elif kind == "trait":
            self.add(path, "trait")
            for member_id in v["items"]:
                member = self.index[str(member_id)]
                (mkind, mv), = member["inner"].items()
                if mkind == "function":
                    self.add(f"{path}::{member['name']}", self.signature(member["name"], mv))
                else:
                    self.add(f"{path}::{member['name']}", mkind)
        elif kind == "function":
            self.add(path, self.signature(item["name"], v))
        elif kind == "constant":
            self.add(path, f"const: {self.ty(v['type'])}")
        elif kind == "static":
            self.add(path, f"static: {self.ty(v['type'])}")
        elif kind == "type_alias":
            self.add(path, f"type = {self.ty(v['type'])}")
            self.impls(path, v.get("impls", []) if isinstance(v, dict) else [])
        else:
            self.add(path, kind)

    def child(self, parent: str, item: dict, seen: frozenset) -> None:
        """A public item of the module at `parent`: a glob import's items join it, anything
        else is reached by its name (a re-export's own)."""
        if item.get("visibility") != "public":
            return
        use = item["inner"].get("use")
        if use is not None and use.get("is_glob"):
            self.item(parent, item, seen)
            return
        name = use["name"] if use is not None else item["name"]
        if name is not None:
            self.item(f"{parent}::{name}", item, seen)

    def run(self) -> list[str]:
        self.item(CRATE, self.index[self.root], frozenset())
        for item_id, paths in self.reached.items():
            shortest = min(paths, key=lambda p: (p.count("::"), p))
            self.describe(shortest, self.index[str(item_id)])
            for other in paths:
                if other != shortest:
                    self.add(other, f"= {shortest}")
        return sorted(self.lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the listing instead of comparing")
    args = parser.parse_args()
    listing = Lister(rustdoc_json()).run()
    text = "\n".join(listing) + "\n"
    if args.write:
        LISTING.parent.mkdir(exist_ok=True)
        LISTING.write_text(text)
        print(f"{LISTING.relative_to(ROOT)}: {len(listing)} items")
        return
    old = LISTING.read_text() if LISTING.exists() else ""
    if old == text:
        print(f"public API unchanged: {len(listing)} items ({LISTING.relative_to(ROOT)})")
        return
    sys.stdout.writelines(
        difflib.unified_diff(
            old.splitlines(keepends=True), text.splitlines(keepends=True),
            str(LISTING.relative_to(ROOT)), "the library as built",
        )
    )
    sys.exit(
        "the public API changed: if that is meant, run `python3 tools/public_api.py --write` "
        "and commit api/public-api.txt with the change"
    )


if __name__ == "__main__":
    main()
