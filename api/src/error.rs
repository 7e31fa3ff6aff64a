//! The one error vocabulary shared by every provider (docs/contract.md section 6).

use std::fmt;

/// Result alias used throughout the framework.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in provider-neutral terms.
///
/// The first eight variants are the completion statuses of the contract; the rest are
/// errors returned synchronously by calls (post, connect, register, configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A received message was longer than the receive buffer that matched it.
    LocalLength,
    /// A local buffer was not usable for the operation (wrong domain, missing access,
    /// deregistered, out of bounds).
    LocalProtection,
    /// The target refused a remote access: bad key, out of bounds, missing access right,
    /// deregistered region, misaligned atomic.
    RemoteAccess,
    /// The target could not accept the request (for a send: its receive was too short).
    RemoteInvalidRequest,
    /// The target failed while executing the operation.
    RemoteOperation,
    /// The peer stopped answering (unreachable, killed, transport retries exhausted).
    RetryExceeded,
    /// The operation was outstanding when the endpoint entered the error state or closed.
    Flushed,
    /// The operation or option is not supported by this provider (see its capabilities).
    Unsupported,
    /// Posting would exceed a queue depth or the completion queue's capacity.
    QueueFull,
    /// An argument was invalid (bad length, bad flags, region of another provider...).
    InvalidArgument,
    /// The endpoint is in the error state or closed; nothing new can be posted.
    InvalidState,
    /// Nobody listens at the address connected to.
    ConnectionRefused,
    /// A connect or wait ran out of time.
    TimedOut,
    /// The peer violated the wire protocol (malformed, oversized or hostile bytes).
    Protocol,
    /// The provider has no usable device.
    NoDevice,
    /// A configuration value (environment, file, builder) was invalid.
    Config,
    /// An operating-system call failed.
    Io,
}

impl ErrorKind {
    /// Short stable name, as used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::LocalLength => "LocalLength",
            ErrorKind::LocalProtection => "LocalProtection",
            ErrorKind::RemoteAccess => "RemoteAccess",
            ErrorKind::RemoteInvalidRequest => "RemoteInvalidRequest",
            ErrorKind::RemoteOperation => "RemoteOperation",
            ErrorKind::RetryExceeded => "RetryExceeded",
            ErrorKind::Flushed => "Flushed",
            ErrorKind::Unsupported => "Unsupported",
            ErrorKind::QueueFull => "QueueFull",
            ErrorKind::InvalidArgument => "InvalidArgument",
            ErrorKind::InvalidState => "InvalidState",
            ErrorKind::ConnectionRefused => "ConnectionRefused",
            ErrorKind::TimedOut => "TimedOut",
            ErrorKind::Protocol => "Protocol",
            ErrorKind::NoDevice => "NoDevice",
            ErrorKind::Config => "Config",
            ErrorKind::Io => "Io",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The provider's own code, kept beside the neutral [`ErrorKind`] (like libfabric's
/// `prov_errno`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum ProviderCode {
    /// An operating-system errno.
    Errno(i32),
    /// A verbs `ibv_wc_status` value.
    WcStatus(u32),
    /// An iWARP Terminate message's layer, error type and error code (RFC 5040 section 4.8).
    Terminate {
        /// Layer: 0 RDMAP, 1 DDP, 2 LLP (MPA).
        layer: u8,
        /// Error type within the layer.
        etype: u8,
        /// Error code within the type.
        ecode: u8,
    },
}

impl fmt::Display for ProviderCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProviderCode::Errno(e) => write!(f, "errno {e}"),
            ProviderCode::WcStatus(s) => write!(f, "ibv_wc_status {s}"),
            ProviderCode::Terminate {
                layer,
                etype,
                ecode,
            } => write!(f, "terminate layer {layer} type {etype} code {ecode:#04x}"),
        }
    }
}

/// An error: the neutral kind, the provider's code where there is one, and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Error {
    kind: ErrorKind,
    code: Option<ProviderCode>,
    message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)?;
        if let Some(code) = &self.code {
            write!(f, " ({code})")?;
        }
        Ok(())
    }
}

impl Error {
    /// An error of `kind` with a human-readable message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            code: None,
            message: message.into(),
        }
    }

    /// Attaches the provider's own code.
    pub fn with_code(mut self, code: ProviderCode) -> Self {
        self.code = Some(code);
        self
    }

    /// The neutral kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The provider's own code, if any.
    pub fn code(&self) -> Option<ProviderCode> {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Shorthand for [`ErrorKind::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// Shorthand for [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unsupported, message)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        let kind = match e.kind() {
            K::ConnectionRefused => ErrorKind::ConnectionRefused,
            K::TimedOut | K::WouldBlock => ErrorKind::TimedOut,
            K::InvalidInput => ErrorKind::InvalidArgument,
            K::InvalidData | K::UnexpectedEof => ErrorKind::Protocol,
            _ => ErrorKind::Io,
        };
        let mut err = Error::new(kind, e.to_string());
        if let Some(errno) = e.raw_os_error() {
            err = err.with_code(ProviderCode::Errno(errno));
        }
        err
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_map_to_neutral_kinds_and_keep_errno() {
        let e: Error = std::io::Error::from_raw_os_error(111).into();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
        assert_eq!(e.code(), Some(ProviderCode::Errno(111)));
        assert!(e.to_string().contains("errno 111"), "{e}");
    }
}
