//! The kernel's sysfs view of RDMA devices: what verbs do not report
//! (GID types and netdevs, NUMA placement). Paths take a root so tests can
//! point them at a fake tree.

use crate::device::{GidType, LinkLayer};
use std::path::{Path, PathBuf};

/// Where the kernel publishes RDMA device attributes.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// Reads a GID entry's type and netdev from sysfs under `root`
/// (normally [`SYSFS_INFINIBAND`]). Missing files are normal (IB ports have
/// no netdev; old kernels no types), so this never fails.
pub fn read_gid_attrs(
    root: &Path,
    device: &str,
    port: u8,
    index: u32,
    link_layer: LinkLayer,
) -> (GidType, Option<String>) {
    let attrs = root
        .join(device)
        .join("ports")
        .join(port.to_string())
        .join("gid_attrs");
    let read = |dir: &str| {
        std::fs::read_to_string(attrs.join(dir).join(index.to_string()))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    let gid_type = match (read("types"), link_layer) {
        (Some(text), ll) => GidType::from_sysfs(&text, ll),
        (None, LinkLayer::Ethernet) => GidType::Unknown(String::new()),
        (None, _) => GidType::Ib,
    };
    (gid_type, read("ndevs"))
}

/// The device's NUMA node from `<root>/<device>/device/numa_node`; `None`
/// when absent, unparsable or negative.
pub fn read_numa_node(root: &Path, device: &str) -> Option<u32> {
    let path: PathBuf = root.join(device).join("device").join("numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs tree under the temp directory, removed on drop.
    struct FakeSysfs(PathBuf);

    impl FakeSysfs {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("multirail-verbs-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn write(&self, rel: &str, text: &str) {
            let path = self.0.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn sysfs_gid_attrs_and_numa() {
        let fs = FakeSysfs::new("gid");
        fs.write("rxe_a/ports/1/gid_attrs/types/0", "IB/RoCE v1\n");
        fs.write("rxe_a/ports/1/gid_attrs/types/1", "RoCE v2\n");
        fs.write("rxe_a/ports/1/gid_attrs/ndevs/1", "eth1\n");
        fs.write("mlx5_0/device/numa_node", "1\n");
        fs.write("mlx5_1/device/numa_node", "-1\n");
        let root = fs.0.as_path();
        assert_eq!(
            read_gid_attrs(root, "rxe_a", 1, 1, LinkLayer::Ethernet),
            (GidType::RoceV2, Some("eth1".into()))
        );
        assert_eq!(
            read_gid_attrs(root, "rxe_a", 1, 0, LinkLayer::Ethernet),
            (GidType::RoceV1, None)
        );
        assert_eq!(
            read_gid_attrs(root, "ib0", 1, 0, LinkLayer::InfiniBand),
            (GidType::Ib, None)
        );
        assert_eq!(read_numa_node(root, "mlx5_0"), Some(1));
        assert_eq!(read_numa_node(root, "mlx5_1"), None);
        assert_eq!(read_numa_node(root, "rxe_a"), None);
    }
}
