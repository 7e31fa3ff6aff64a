//! rdma-core loaded at run time: libibverbs and librdmacm are opened with `dlopen` the first
//! time a verbs provider looks for devices, never linked, so a binary built with the verbs
//! providers starts on a machine without rdma-core and reports them unavailable (with the
//! reason, e.g. `libibverbs.so.1 not found`) while the tcp provider runs.
//!
//! This module is a drop-in for the `rdma_sys` paths [`ffi`](crate) used to name: the C
//! types are `rdma-sys`'s own (re-exported below, so layouts stay bindgen's), and every
//! exported C function the core calls is a function of the same name and signature here that
//! jumps through a pointer resolved once with `dlsym` (in a [`OnceLock`]). Only the functions
//! listed in `rdma_core_api!` exist: calling another `rdma_sys` function would link the
//! libraries again, so the list is explicit rather than a glob re-export, and `scripts/test`
//! checks with `ldd` that the binary needs neither library.
//!
//! The verbs "functions" that `<infiniband/verbs.h>` defines `static inline` (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) are jumps through the device
//! context's `ops` table; `rdma-sys` implements them in Rust the same way, referencing no
//! library symbol, so they are re-exported as they are. `___ibv_query_port` (the inline
//! behind `ibv_query_port`) is reimplemented here over the exported `ibv_query_port`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libc::sockaddr;

pub(crate) use rdma_sys::{
    atomic_t, ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr, ibv_gid,
    ibv_gid_entry, ibv_mr, ibv_pd, ibv_poll_cq, ibv_port_attr, ibv_post_recv, ibv_post_send,
    ibv_qp, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr, ibv_qp_type, ibv_recv_wr,
    ibv_req_notify_cq, ibv_send_wr, ibv_sge, ibv_wc, ibv_wr_opcode, rdma_cm_event, rdma_cm_id,
    rdma_conn_param, rdma_event_channel, rdma_port_space, rdma_t,
};

/// The soname of libibverbs (ABI 1, unchanged since 2006).
pub const LIBIBVERBS: &str = "libibverbs.so.1";
/// The soname of librdmacm.
pub const LIBRDMACM: &str = "librdmacm.so.1";

/// Why rdma-core could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// `dlopen` found no such library: rdma-core is not installed.
    NotFound {
        /// The soname asked for.
        library: String,
        /// `dlerror()`'s words.
        detail: String,
    },
    /// A file of that name exists but `dlopen` could not load it (wrong architecture,
    /// damaged, a dependency missing).
    Unloadable {
        /// The soname asked for.
        library: String,
        /// `dlerror()`'s words.
        detail: String,
    },
    /// The library loaded but lacks a function the core calls (an rdma-core too old).
    MissingSymbol {
        /// The soname.
        library: String,
        /// The function.
        symbol: String,
        /// `dlerror()`'s words.
        detail: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound { library, detail } => write!(
                f,
                "{library} not found: rdma-core is not installed ({detail}); install it (Debian/Ubuntu: libibverbs1 librdmacm1 ibverbs-providers; RHEL/Fedora: rdma-core libibverbs librdmacm)"
            ),
            LoadError::Unloadable { library, detail } => write!(
                f,
                "{library} could not be loaded ({detail}); reinstall rdma-core for this architecture"
            ),
            LoadError::MissingSymbol {
                library,
                symbol,
                detail,
            } => write!(
                f,
                "{library} has no {symbol} ({detail}): rdma-core is too old; install rdma-core 28 or later"
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// The rdma-core libraries this process loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaCore {
    /// The file libibverbs was loaded from (symbolic links resolved).
    pub libibverbs: PathBuf,
    /// The file librdmacm was loaded from (symbolic links resolved).
    pub librdmacm: PathBuf,
}

impl RdmaCore {
    /// rdma-core's release, read from the library's file name (rdma-core names its
    /// libraries `libibverbs.so.<abi>.<minor>.<release>`, e.g. `libibverbs.so.1.14.44.0` is
    /// release 44.0); `None` when the name does not follow that scheme.
    pub fn version(&self) -> Option<String> {
        release_from_file_name(&self.libibverbs)
    }
}

/// The release part of `lib*.so.<abi>.<minor>.<release...>`.
fn release_from_file_name(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let (_, after) = name.split_once(".so.")?;
    let parts: Vec<&str> = after.split('.').collect();
    if parts.len() < 3
        || !parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    Some(parts[2..].join("."))
}

/// Loads rdma-core (once per process) and says where from, or why it could not.
pub fn rdma_core() -> Result<RdmaCore, LoadError> {
    load().map(|l| l.files.clone()).map_err(Clone::clone)
}

/// One library opened with `dlopen`; never closed (the functions stay valid for the life
/// of the process).
struct Lib {
    handle: *mut c_void,
    name: &'static str,
}

/// `dlerror()`'s message, or a fallback.
fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc, valid until the
    // next dl* call on this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "no reason given".into()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Lib {
    fn open(name: &'static str) -> Result<Lib, LoadError> {
        let c = CString::new(name).expect("sonames have no NUL");
        // SAFETY: `c` is a NUL-terminated file name. Loading runs the library's constructors,
        // which is what linking it would have done at start-up.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            let detail = dlerror_text();
            let library = name.into();
            // glibc's words for ENOENT along the whole search path.
            return Err(if detail.contains("No such file or directory") {
                LoadError::NotFound { library, detail }
            } else {
                LoadError::Unloadable { library, detail }
            });
        }
        Ok(Lib { handle, name })
    }

    fn symbol(&self, sym: &CStr) -> Result<*mut c_void, LoadError> {
        // SAFETY: `handle` came from a successful dlopen and is never closed; `sym` is
        // NUL-terminated.
        let p = unsafe { libc::dlsym(self.handle, sym.as_ptr()) };
        if p.is_null() {
            return Err(LoadError::MissingSymbol {
                library: self.name.into(),
                symbol: sym.to_string_lossy().into_owned(),
                detail: dlerror_text(),
            });
        }
        Ok(p)
    }

    /// The file the library was loaded from, found from one of its symbols.
    fn file(&self, sym: *mut c_void) -> PathBuf {
        // SAFETY: all-zero is a valid Dl_info (null pointers).
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: `sym` is an address inside the loaded library; `info` is an out-pointer.
        let found = unsafe { libc::dladdr(sym, &mut info) } != 0 && !info.dli_fname.is_null();
        if !found {
            return PathBuf::from(self.name);
        }
        // SAFETY: dladdr set dli_fname to the NUL-terminated path of the loaded object.
        let p = unsafe { CStr::from_ptr(info.dli_fname) };
        let p = PathBuf::from(p.to_string_lossy().into_owned());
        std::fs::canonicalize(&p).unwrap_or(p)
    }
}

/// The two libraries, by the short names the table below uses.
struct Libs {
    ibv: Lib,
    cm: Lib,
}

/// Declares the table of rdma-core functions and, for each, a function of the same name and
/// signature that calls through the table.
macro_rules! rdma_core_api {
    ($( $lib:ident $sym:literal fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?; )*) => {
        /// rdma-core's entry points, resolved with `dlsym`.
        struct Api {
            $( $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?, )*
        }

        impl Api {
            fn resolve(libs: &Libs) -> Result<Api, LoadError> {
                Ok(Api {
                    $( $name: {
                        let p = libs.$lib.symbol($sym)?;
                        // SAFETY: `p` is the address of rdma-core's exported C function of
                        // this name, whose prototype (<infiniband/verbs.h>,
                        // <rdma/rdma_cma.h>) is the signature declared beside it, in
                        // rdma-sys's types (generated from those headers).
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) $(-> $ret)?>(p)
                        }
                    }, )*
                })
            }
        }

        $(
            #[doc = concat!("`", stringify!($name), "` from rdma-core, called through the run-time table.")]
            ///
            /// # Safety
            /// The C function's contract. rdma-core must have loaded ([`load`]); every caller
            /// works on objects that only exist after it did.
            pub(crate) unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: the caller upholds the C function's contract (see above).
                unsafe { (api().$name)($($arg),*) }
            }
        )*
    };
}

rdma_core_api! {
    ibv c"ibv_get_device_list" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device;
    ibv c"ibv_free_device_list" fn ibv_free_device_list(list: *mut *mut ibv_device);
    ibv c"ibv_get_device_name" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char;
    ibv c"ibv_open_device" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context;
    ibv c"ibv_close_device" fn ibv_close_device(ctx: *mut ibv_context) -> c_int;
    ibv c"ibv_query_device" fn ibv_query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int;
    ibv c"ibv_query_port" fn ibv_query_port_compat(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int;
    ibv c"ibv_query_gid" fn ibv_query_gid(ctx: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
    ibv c"ibv_alloc_pd" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    ibv c"ibv_dealloc_pd" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int;
    ibv c"ibv_reg_mr" fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
    ibv c"ibv_dereg_mr" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
    ibv c"ibv_create_comp_channel" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel;
    ibv c"ibv_destroy_comp_channel" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int;
    ibv c"ibv_create_cq" fn ibv_create_cq(ctx: *mut ibv_context, cqe: c_int, cq_ctx: *mut c_void, ch: *mut ibv_comp_channel, vector: c_int) -> *mut ibv_cq;
    ibv c"ibv_destroy_cq" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int;
    ibv c"ibv_get_cq_event" fn ibv_get_cq_event(ch: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, cq_ctx: *mut *mut c_void) -> c_int;
    ibv c"ibv_ack_cq_events" fn ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint);
    ibv c"ibv_create_qp" fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv c"ibv_destroy_qp" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
    ibv c"ibv_query_qp" fn ibv_query_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int, init: *mut ibv_qp_init_attr) -> c_int;
    ibv c"ibv_modify_qp" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int;
    cm c"rdma_get_devices" fn rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context;
    cm c"rdma_free_devices" fn rdma_free_devices(list: *mut *mut ibv_context);
    cm c"rdma_create_event_channel" fn rdma_create_event_channel() -> *mut rdma_event_channel;
    cm c"rdma_destroy_event_channel" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel);
    cm c"rdma_get_cm_event" fn rdma_get_cm_event(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int;
    cm c"rdma_ack_cm_event" fn rdma_ack_cm_event(ev: *mut rdma_cm_event) -> c_int;
    cm c"rdma_create_id" fn rdma_create_id(ch: *mut rdma_event_channel, id: *mut *mut rdma_cm_id, ctx: *mut c_void, ps: rdma_port_space::Type) -> c_int;
    cm c"rdma_destroy_id" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int;
    cm c"rdma_bind_addr" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int;
    cm c"rdma_listen" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int;
    cm c"rdma_resolve_addr" fn rdma_resolve_addr(id: *mut rdma_cm_id, src: *mut sockaddr, dst: *mut sockaddr, timeout_ms: c_int) -> c_int;
    cm c"rdma_resolve_route" fn rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int;
    cm c"rdma_set_option" fn rdma_set_option(id: *mut rdma_cm_id, level: c_int, name: c_int, val: *mut c_void, len: usize) -> c_int;
    cm c"rdma_create_qp" fn rdma_create_qp(id: *mut rdma_cm_id, pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> c_int;
    cm c"rdma_destroy_qp" fn rdma_destroy_qp(id: *mut rdma_cm_id);
    cm c"rdma_connect" fn rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int;
    cm c"rdma_accept" fn rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int;
    cm c"rdma_reject" fn rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int;
    cm c"rdma_disconnect" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int;
}

/// `ibv_query_port` as `<infiniband/verbs.h>`'s inline `___ibv_query_port` falls back to it:
/// the exported function fills the caller's whole `ibv_port_attr` through the device's
/// `query_port` op (the same path `rdma-sys`'s inline of this name took).
///
/// # Safety
/// `ctx` is an open device context; `attr` points at a writable `ibv_port_attr`.
pub(crate) unsafe fn ___ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller's contract; verbs.h clears the struct before this call.
    unsafe {
        attr.write_bytes(0, 1);
        ibv_query_port_compat(ctx, port, attr)
    }
}

/// `_ibv_query_gid_table` (rdma-core 30 and later; `<infiniband/verbs.h>`'s inline
/// `ibv_query_gid_table` calls it with the entry size): every valid GID of a device in one
/// call, where `ibv_query_gid` costs one kernel call per index, empty or not (rxe's tables
/// have 1024 entries, so a probe of three rxe devices made about 3,000 calls).
type QueryGidTable = unsafe extern "C" fn(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize;

/// What loading produced, kept for the life of the process.
struct Loaded {
    api: Api,
    /// Functions newer rdma-core has and older lacks: `None` selects the fallback.
    query_gid_table: Option<QueryGidTable>,
    files: RdmaCore,
}

/// Every valid GID of the device behind `ctx`, at most `entries.len()` of them: the number
/// written, a negative errno, or `None` when this rdma-core predates the call.
///
/// # Safety
/// `ctx` is an open device context.
pub(crate) unsafe fn ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: &mut [ibv_gid_entry],
) -> Option<isize> {
    let f = load().ok()?.query_gid_table?;
    // SAFETY: `ctx` is open (the caller's contract); `entries` is a writable array of
    // `entries.len()` elements of the size passed, which is what the function fills.
    Some(unsafe {
        f(
            ctx,
            entries.as_mut_ptr(),
            entries.len(),
            0,
            std::mem::size_of::<ibv_gid_entry>(),
        )
    })
}

static LOADED: OnceLock<Result<Loaded, LoadError>> = OnceLock::new();

/// Opens libibverbs and librdmacm and resolves every function, once per process.
fn load() -> Result<&'static Loaded, &'static LoadError> {
    LOADED
        .get_or_init(|| {
            let ibv = Lib::open(LIBIBVERBS)?;
            let cm = Lib::open(LIBRDMACM)?;
            let libs = Libs { ibv, cm };
            let api = Api::resolve(&libs)?;
            let query_gid_table = libs.ibv.symbol(c"_ibv_query_gid_table").ok().map(|p| {
                // SAFETY: `p` is rdma-core's exported `_ibv_query_gid_table`, whose prototype
                // in <infiniband/verbs.h> is `QueryGidTable` (ssize_t is isize here).
                unsafe { std::mem::transmute::<*mut c_void, QueryGidTable>(p) }
            });
            let files = RdmaCore {
                libibverbs: libs.ibv.file(api.ibv_get_device_list as *mut c_void),
                librdmacm: libs.cm.file(api.rdma_create_event_channel as *mut c_void),
            };
            tracing::debug!(
                libibverbs = %files.libibverbs.display(),
                librdmacm = %files.librdmacm.display(),
                "rdma-core loaded"
            );
            Ok(Loaded {
                api,
                query_gid_table,
                files,
            })
        })
        .as_ref()
}

/// The table, for the wrappers. Every path into rdma-core starts at device discovery
/// (`device::probe`), which calls [`load`] and reports its error; reaching a wrapper without
/// it is a bug in this crate.
fn api() -> &'static Api {
    match load() {
        Ok(l) => &l.api,
        Err(e) => panic!("fabric-verbs called rdma-core, which did not load ({e}); discovery should have reported this"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_is_read_from_the_file_name() {
        let v = |s: &str| release_from_file_name(Path::new(s));
        assert_eq!(
            v("/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0").as_deref(),
            Some("44.0")
        );
        assert_eq!(v("librdmacm.so.1.3.50.1").as_deref(), Some("50.1"));
        assert_eq!(v("libibverbs.so.1.14.44").as_deref(), Some("44"));
        assert_eq!(v("libibverbs.so.1"), None);
        assert_eq!(v("libibverbs.so.1.14"), None);
        assert_eq!(v("libibverbs.so.1.x.44.0"), None);
        assert_eq!(v("libibverbs.so"), None);
    }

    #[test]
    fn a_missing_library_is_named() {
        let e = Lib::open("libfabric-no-such-library.so.1").err().unwrap();
        match &e {
            LoadError::NotFound { library, detail } => {
                assert_eq!(library, "libfabric-no-such-library.so.1");
                assert!(!detail.is_empty());
            }
            other => panic!("{other:?}"),
        }
        assert!(
            e.to_string()
                .starts_with("libfabric-no-such-library.so.1 not found"),
            "{e}"
        );
    }

    #[test]
    fn a_file_that_is_no_library_is_unloadable() {
        let dir = std::env::temp_dir().join(format!("fabric-verbs-sys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("libnot-an-elf.so.1");
        std::fs::write(&f, b"not an ELF file").unwrap();
        let name: &'static str = Box::leak(f.to_string_lossy().into_owned().into_boxed_str());
        let e = Lib::open(name).err().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            matches!(&e, LoadError::Unloadable { library, .. } if library == name),
            "{e:?}"
        );
        assert!(e.to_string().contains("could not be loaded"), "{e}");
    }

    #[test]
    fn a_missing_function_is_named() {
        let libc = Lib::open("libc.so.6").unwrap();
        assert!(libc.symbol(c"getpid").is_ok());
        let e = libc.symbol(c"ibv_no_such_function").unwrap_err();
        assert!(
            matches!(&e, LoadError::MissingSymbol { symbol, .. } if symbol == "ibv_no_such_function"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("libc.so.6 has no ibv_no_such_function"),
            "{e}"
        );
    }

    #[test]
    fn loading_agrees_with_the_file_system() {
        // Where the dynamic loader's default paths hold libibverbs, loading must succeed and
        // name the file; where they hold none, it must fail naming libibverbs.
        let present = [
            "/lib",
            "/usr/lib",
            "/lib64",
            "/usr/lib64",
            "/lib/x86_64-linux-gnu",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
        ]
        .iter()
        .any(|d| Path::new(d).join(LIBIBVERBS).exists());
        match rdma_core() {
            Ok(r) => {
                assert!(r.libibverbs.exists(), "{r:?}");
                assert!(r.librdmacm.exists(), "{r:?}");
                assert!(
                    r.libibverbs.to_string_lossy().contains("libibverbs"),
                    "{r:?}"
                );
            }
            Err(e) => assert!(!present, "libibverbs is installed but did not load: {e}"),
        }
    }
}
