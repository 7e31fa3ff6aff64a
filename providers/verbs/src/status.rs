//! `ibv_wc_status` to the shared error vocabulary (docs/contract.md section 6), in one place.
//! The raw status always travels beside the neutral kind as [`ProviderCode::WcStatus`].

use fabric_api::{ErrorKind, ProviderCode};

/// `ibv_wc_status` values (rdma-core `verbs.h`).
pub mod wc {
    /// Success.
    pub const SUCCESS: u32 = 0;
    /// Local length error: the receive was shorter than the message.
    pub const LOC_LEN_ERR: u32 = 1;
    /// Local QP operation error.
    pub const LOC_QP_OP_ERR: u32 = 2;
    /// Local EE context operation error.
    pub const LOC_EEC_OP_ERR: u32 = 3;
    /// Local protection error.
    pub const LOC_PROT_ERR: u32 = 4;
    /// Work request flushed (the QP is in the error state).
    pub const WR_FLUSH_ERR: u32 = 5;
    /// Memory window bind error.
    pub const MW_BIND_ERR: u32 = 6;
    /// Bad response.
    pub const BAD_RESP_ERR: u32 = 7;
    /// Local access error.
    pub const LOC_ACCESS_ERR: u32 = 8;
    /// Remote invalid request.
    pub const REM_INV_REQ_ERR: u32 = 9;
    /// Remote access error.
    pub const REM_ACCESS_ERR: u32 = 10;
    /// Remote operation error.
    pub const REM_OP_ERR: u32 = 11;
    /// Transport retry counter exceeded.
    pub const RETRY_EXC_ERR: u32 = 12;
    /// RNR retry counter exceeded.
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
    /// Local RDD violation.
    pub const LOC_RDD_VIOL_ERR: u32 = 14;
    /// Remote invalid RD request.
    pub const REM_INV_RD_REQ_ERR: u32 = 15;
    /// Remote aborted.
    pub const REM_ABORT_ERR: u32 = 16;
    /// Invalid EE context number.
    pub const INV_EECN_ERR: u32 = 17;
    /// Invalid EE context state.
    pub const INV_EEC_STATE_ERR: u32 = 18;
    /// Fatal error.
    pub const FATAL_ERR: u32 = 19;
    /// Response timeout.
    pub const RESP_TIMEOUT_ERR: u32 = 20;
    /// General error.
    pub const GENERAL_ERR: u32 = 21;
}

/// The neutral kind of a failed completion's `ibv_wc_status`.
///
/// Local QP/EEC/RDD consistency errors have no kind of their own in the vocabulary; they
/// are reported as `LocalProtection` (the request was not usable locally). Device-fatal
/// and unknown statuses are reported as `RemoteOperation` ("failed while executing"). The
/// raw status is kept beside the kind in every case.
pub fn kind_of(status: u32) -> ErrorKind {
    match status {
        wc::LOC_LEN_ERR => ErrorKind::LocalLength,
        wc::LOC_QP_OP_ERR
        | wc::LOC_EEC_OP_ERR
        | wc::LOC_PROT_ERR
        | wc::MW_BIND_ERR
        | wc::LOC_ACCESS_ERR
        | wc::LOC_RDD_VIOL_ERR => ErrorKind::LocalProtection,
        wc::WR_FLUSH_ERR => ErrorKind::Flushed,
        wc::REM_INV_REQ_ERR | wc::REM_INV_RD_REQ_ERR => ErrorKind::RemoteInvalidRequest,
        wc::REM_ACCESS_ERR => ErrorKind::RemoteAccess,
        wc::RETRY_EXC_ERR | wc::RNR_RETRY_EXC_ERR | wc::RESP_TIMEOUT_ERR => {
            ErrorKind::RetryExceeded
        }
        _ => ErrorKind::RemoteOperation,
    }
}

/// The kind and provider code of a failed completion.
pub fn error_of(status: u32) -> (ErrorKind, ProviderCode) {
    (kind_of(status), ProviderCode::WcStatus(status))
}

/// The name rdma-core gives a status (`ibv_wc_status_str`), for messages.
pub fn name_of(status: u32) -> &'static str {
    const NAMES: [&str; 22] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "Work Request Flushed Error",
        "memory management operation error",
        "bad response error",
        "local access error",
        "remote invalid request error",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation error",
        "remote invalid RD request",
        "aborted error",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout error",
        "general error",
    ];
    NAMES.get(status as usize).copied().unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_maps_and_keeps_its_code() {
        let expect = [
            (wc::LOC_LEN_ERR, ErrorKind::LocalLength),
            (wc::LOC_PROT_ERR, ErrorKind::LocalProtection),
            (wc::LOC_ACCESS_ERR, ErrorKind::LocalProtection),
            (wc::LOC_QP_OP_ERR, ErrorKind::LocalProtection),
            (wc::WR_FLUSH_ERR, ErrorKind::Flushed),
            (wc::REM_INV_REQ_ERR, ErrorKind::RemoteInvalidRequest),
            (wc::REM_INV_RD_REQ_ERR, ErrorKind::RemoteInvalidRequest),
            (wc::REM_ACCESS_ERR, ErrorKind::RemoteAccess),
            (wc::REM_OP_ERR, ErrorKind::RemoteOperation),
            (wc::REM_ABORT_ERR, ErrorKind::RemoteOperation),
            (wc::BAD_RESP_ERR, ErrorKind::RemoteOperation),
            (wc::RETRY_EXC_ERR, ErrorKind::RetryExceeded),
            (wc::RNR_RETRY_EXC_ERR, ErrorKind::RetryExceeded),
            (wc::RESP_TIMEOUT_ERR, ErrorKind::RetryExceeded),
            (wc::FATAL_ERR, ErrorKind::RemoteOperation),
            (99, ErrorKind::RemoteOperation),
        ];
        for (s, k) in expect {
            assert_eq!(error_of(s), (k, ProviderCode::WcStatus(s)), "status {s}");
        }
        for s in 1..=wc::GENERAL_ERR {
            assert_ne!(kind_of(s), ErrorKind::Unsupported);
            assert_ne!(name_of(s), "unknown");
        }
        assert_eq!(name_of(5), "Work Request Flushed Error");
    }
}
