"""docs/settings.md, rendered from the settings classes themselves (so it cannot drift).

    python -m kvtier.tools.settings_doc > docs/settings.md

`tests/tools/test_settings_doc.py` fails when the file differs from what this renders.
"""

from __future__ import annotations

from kvtier.core.settings import Settings, StoreSettings, describe_fields
from kvtier.router.settings import ReplicaSettings, RouterSettings
from kvtier.tools.cluster.spec import CacheSpec, FleetSpec, L2Spec, LocalSpec, RoutingSpec
from kvtier.tools.deploy.settings import KubernetesSpec, Resources
from kvtier.vllm.settings import ConnectorSettings

__all__ = ["render"]

HEAD = """# Settings

Every kvtier setting, generated from the settings classes (`python -m kvtier.tools.settings_doc
> docs/settings.md`; a test keeps this file in sync). Units are in the names: `_bytes` settings
take a byte count or a size with a binary unit (`4GiB`, `512M`), `_s` seconds, `_ms`
milliseconds, `_mode` file permissions as an octal string (`"0o640"`; a bare number is an error
in a document or the extra config, as YAML and JSON read 400 as decimal). A bad value or an
unknown key is an error naming the full key.

Where each set is given:

- store and connector: vLLM's `kv_connector_extra_config` (JSON keys as below), or
  `KVTIER_<KEY>` in the replica's environment (the extra config wins), or
  `kvtier serve --<key-with-dashes>`, or the deployment file's `kvtier.connector` section;
- router: `kvtier router --<key-with-dashes>` (`--replica` for `replicas`, `--model` for
  `model_dir`), or the deployment file's `kvtier.router` section;
- deployment file: the YAML file of `kvtier up --config` and `kvtier deploy render` (its
  `kubernetes` section is read by `kvtier deploy render` only).
"""


def _table(cls: type[Settings], skip: tuple[str, ...] = ()) -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, default, text in describe_fields(cls):
        if name not in skip:
            rows.append(f"| `{name}` | `{default}` | {text.replace('|', '&#124;')} |")
    return "\n".join(rows)


def render() -> str:
    """The whole of docs/settings.md."""
    store_keys = tuple(StoreSettings.model_fields)
    sections = [
        HEAD,
        "## Store (`StoreSettings`): one replica's L1 and L2\n\n" + _table(StoreSettings),
        "## Connector (`ConnectorSettings`): the store's settings, plus\n\n"
        + _table(ConnectorSettings, skip=store_keys),
        "## Router (`RouterSettings`)\n\n" + _table(RouterSettings),
        "A replica (`ReplicaSettings`) is a URL, `URL=VLLM_EVENTS_ENDPOINT`, or an object:\n\n"
        + _table(ReplicaSettings),
        "## Deployment file (`FleetSpec`)\n\nTop level:\n\n" + _table(FleetSpec),
        "`intelligentRoutingSpec`:\n\n" + _table(RoutingSpec),
        "`kvCacheSpec`:\n\n" + _table(CacheSpec),
        "`kvCacheSpec.l2CacheSpec`:\n\n" + _table(L2Spec),
        "`kvtier`:\n\n" + _table(LocalSpec),
        "`kubernetes` (`KubernetesSpec`), read by `kvtier deploy render` only "
        "(docs/kubernetes.md):\n\n" + _table(KubernetesSpec),
        "`kubernetes.replicaResources` and `kubernetes.routerResources` (`Resources`):\n\n"
        + _table(Resources),
    ]
    return "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    print(render(), end="")
