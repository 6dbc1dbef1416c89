"""Prints the public API of a crate from its rustdoc JSON (see `run`), sorted: one line
per reachable item (by the path a user names it with, following `pub use`), public
field, enum variant and public inherent method."""
import json
import sys


def main(path):
    doc = json.load(open(path))
    index = doc["index"]
    lines = set()
    seen = set()

    def kind(item):
        return next(iter(item["inner"]))

    def visit(item_id, at):
        if (item_id, at) in seen or str(item_id) not in index:
            return
        seen.add((item_id, at))
        item = index[str(item_id)]
        k = kind(item)
        inner = item["inner"][k]
        if k == "module":
            for child_id in inner["items"]:
                child = index.get(str(child_id))
                if child is None or child.get("visibility") != "public":
                    continue
                if kind(child) == "use":
                    use = child["inner"]["use"]
                    if use.get("id") is not None:
                        visit(use["id"], at if use.get("is_glob") else f"{at}::{use['name']}")
                else:
                    visit(child_id, f"{at}::{child['name']}")
            return
        lines.add(f"{k} {at}")
        if k == "struct" and isinstance(inner["kind"], dict):
            for f in inner["kind"].get("plain", {}).get("fields", []):
                field = index.get(str(f))
                if field and field.get("visibility") == "public":
                    lines.add(f"field {at}.{field['name']}")
        if k == "enum":
            for v in inner["variants"]:
                lines.add(f"variant {at}::{index[str(v)]['name']}")
        for impl_id in inner.get("impls", []):
            imp = index[str(impl_id)]["inner"]["impl"]
            if imp.get("trait") is not None or imp.get("is_synthetic") or imp.get("blanket_impl"):
                continue
            for m in imp["items"]:
                method = index.get(str(m))
                if method and method.get("visibility") == "public":
                    lines.add(f"method {at}::{method['name']}")

    visit(doc["root"], index[str(doc["root"])]["name"])
    print("\n".join(sorted(lines)))


if __name__ == "__main__":
    main(sys.argv[1])
