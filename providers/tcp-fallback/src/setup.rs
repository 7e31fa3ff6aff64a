//! Connection setup: TCP connect / accept, then the MPA Request / Reply exchange.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;

use fabric_api::emu_wire::{self, ExtDesc};
use fabric_api::{pdata, Error, ErrorKind, Result};

use crate::conn::Negotiated;
use crate::credit::LocalArea;
use crate::emu::{self, LocalEmu};
use crate::keys::KeyTable;
use crate::wire::mpa::{self, Enhanced, ExtBlock, MpaFrame, RtrKinds, Setup};
use crate::TcpOptions;

/// Inbound reads and atomics we serve concurrently (IRD): the receive machine answers
/// them in order, so the number only bounds what the peer may queue.
pub(crate) const IRD: u16 = 64;
/// Outbound reads and atomics we want in flight (ORD).
pub(crate) const ORD: u16 = 64;

/// Reads and atomics we may have in flight: our ORD, bounded by the peer's IRD (RFC 6581);
/// one for a revision-1 peer, which does not say.
fn our_ord(peer: Option<Enhanced>) -> u32 {
    peer.map_or(1, |e| e.ird.clamp(1, ORD)).into()
}

fn protocol(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, what.into())
}

/// Largest application private data a reply to this framework's iwarp provider frames
/// (the frame's length byte; the iwarp provider accepts no more anyway).
const FRAMED_MAX: usize = 200;

fn user_pd_check(pd: &[u8]) -> Result<()> {
    if pd.len() > crate::MAX_PRIVATE_DATA as usize {
        return Err(Error::invalid(format!(
            "private data of {} bytes exceeds the maximum of {}",
            pd.len(),
            crate::MAX_PRIVATE_DATA
        )));
    }
    Ok(())
}

/// Initiator side, first half: the MPA Request to send.
pub(crate) fn request(opts: &TcpOptions, private_data: &[u8]) -> Result<Vec<u8>> {
    user_pd_check(private_data)?;
    let req = MpaFrame {
        reply: false,
        markers: false,
        crc: opts.crc,
        reject: false,
        enhanced: true,
        ext_offer: opts.extensions,
        revision: 2,
        private_data: Setup {
            enhanced: Some(Enhanced {
                ird: IRD,
                ord: ORD,
                peer_to_peer: false,
                rtr: RtrKinds::default(),
            }),
            ext: None,
            user: private_data.to_vec(),
        }
        .encode(),
    };
    Ok(req.encode())
}

/// Initiator side, second half: checks the peer's MPA Reply to [`request`] and says what
/// was agreed. Against this framework's iwarp provider (its reply's frame names its credit
/// area) our own credit area is registered in `keys`: the connection runs credits, and
/// the endpoint names the area to the peer first thing ([`crate::conn::Conn::start`]).
/// When that reply's frame also ends with the emulation trailer ([`crate::emu`]), our
/// emulation area (one immediate-data slot per entry of a receive queue of `rq_depth`)
/// is registered too, and named to the peer with the credit area.
pub(crate) fn accept_reply(
    rep: &MpaFrame,
    opts: &TcpOptions,
    keys: &Arc<KeyTable>,
    rq_depth: u32,
) -> Result<Negotiated> {
    if rep.revision > 2 {
        return Err(protocol(format!(
            "MPA reply revision {} is newer than the request's 2",
            rep.revision
        )));
    }
    let setup = Setup::of(rep)?;
    if rep.reject {
        return Err(Error::new(
            ErrorKind::ConnectionRefused,
            format!(
                "peer rejected the connection (MPA reject){}",
                reject_reason(&setup.user)
            ),
        ));
    }
    if rep.markers {
        return Err(protocol(
            "peer wants MPA markers, which this provider never uses",
        ));
    }
    if let Some(e) = setup.enhanced.filter(|e| e.peer_to_peer) {
        return Err(protocol(format!(
            "peer replied with peer-to-peer mode ({:?}) that was not requested",
            e.rtr
        )));
    }
    let (peer_private, peer_area) = app_data(&setup.user)?;
    let peer_emu =
        peer_area.and_then(|_| emu::offered(ExtDesc::find(&setup.user, peer_private.len())));
    Ok(Negotiated {
        features: setup
            .ext
            .map(|x| x.features & features_of(opts))
            .unwrap_or(0),
        crc: rep.crc,
        ord: our_ord(setup.enhanced),
        revision: rep.revision,
        peer_private,
        expect_send_rtr: false,
        area: peer_area.map(|_| Arc::new(LocalArea::new(keys))),
        peer_area,
        emu: peer_emu.map(|_| Arc::new(LocalEmu::new(keys, rq_depth))),
        peer_emu,
        initiator: true,
    })
}

/// The peer's application private data, unwrapped from the frame of this framework's
/// iwarp provider, and that provider's credit area (`None` for any other peer).
fn app_data(user: &[u8]) -> Result<(Vec<u8>, Option<pdata::AreaDesc>)> {
    pdata::unframe(user, true)
}

fn reject_reason(pd: &[u8]) -> String {
    if pd.is_empty() {
        String::new()
    } else {
        format!(": {}", String::from_utf8_lossy(pd))
    }
}

fn features_of(opts: &TcpOptions) -> u8 {
    if opts.extensions {
        mpa::features::ALL
    } else {
        0
    }
}

/// Responder side: answers the MPA Request `req`, which the listener has already read
/// (without blocking anyone: see [`crate::listen`]). A request from this framework's
/// iwarp provider gets a framed reply naming our credit area, registered in `keys`, and,
/// when the request's frame ended with the emulation trailer ([`crate::emu`]), ending with
/// ours (an emulation area with one immediate-data slot per entry of a receive queue of
/// `rq_depth`).
pub(crate) fn respond(
    sock: &mut TcpStream,
    req: MpaFrame,
    opts: &TcpOptions,
    private_data: &[u8],
    keys: &Arc<KeyTable>,
    rq_depth: u32,
) -> Result<Negotiated> {
    user_pd_check(private_data)?;
    let revision = req.revision.min(2);
    let reject = |sock: &mut TcpStream, why: &str| -> Error {
        let f = MpaFrame::reject(revision, why);
        let _ = sock.write_all(&f.encode());
        protocol(format!("rejected connection request: {why}"))
    };
    if req.markers {
        return Err(reject(sock, "MPA markers are not supported"));
    }
    let setup = match Setup::of(&req) {
        Ok(s) => s,
        Err(e) => return Err(reject(sock, &e.to_string())),
    };
    let (peer_private, peer_area) = match app_data(&setup.user) {
        Ok(x) => x,
        Err(e) => return Err(reject(sock, &e.to_string())),
    };
    let ours = features_of(opts);
    let mut expect_send_rtr = false;
    let enhanced = setup.enhanced.map(|e| {
        let mut rtr = RtrKinds::default();
        if e.peer_to_peer {
            // RFC 6581: the responder picks one of the offered RTR kinds.
            if e.rtr.write {
                rtr.write = true;
            } else if e.rtr.read {
                rtr.read = true;
            } else {
                rtr.send = true;
                expect_send_rtr = true;
            }
        }
        Enhanced {
            ird: IRD,
            ord: e.ird.clamp(1, ORD),
            peer_to_peer: e.peer_to_peer,
            rtr,
        }
    });
    let crc = req.crc || opts.crc;
    let ext = if req.ext_offer && opts.extensions {
        Some(ExtBlock {
            version: ExtBlock::VERSION,
            features: ours,
        })
    } else {
        None
    };
    // A request from this framework's iwarp provider (its frame names its credit area):
    // answer with a frame too, naming our credit area (the connection runs credits both
    // ways, see [`crate::credit`]); the frame also tells it that we answer zero-length
    // RDMA Reads (delivery reads, liveness probes), which it sends no foreign iWARP stack.
    // Its trailer (after its application bytes) offers the emulation of atomics and
    // immediate data: ours follows our application bytes, naming our emulation area.
    let (user, area, emu_pair) = match peer_area {
        Some(_) if private_data.len() <= FRAMED_MAX => {
            let area = Arc::new(LocalArea::new(keys));
            let mut user = pdata::frame(private_data, Some(area.desc()));
            let offer = emu::offered(ExtDesc::find(&setup.user, peer_private.len()))
                .filter(|_| private_data.len() + emu_wire::EXT_LEN <= FRAMED_MAX);
            let pair = offer.map(|p| {
                let ours = Arc::new(LocalEmu::new(keys, rq_depth));
                user.extend_from_slice(&ours.desc().encode());
                (ours, p)
            });
            (user, Some(area), pair)
        }
        _ => (private_data.to_vec(), None, None),
    };
    let (emu, peer_emu) = match emu_pair {
        Some((ours, p)) => (Some(ours), Some(p)),
        None => (None, None),
    };
    // Answer in kind: the IRD/ORD block (and the E bit) only when the request had them.
    let rep = MpaFrame {
        reply: true,
        markers: false,
        crc,
        reject: false,
        enhanced: enhanced.is_some(),
        ext_offer: false,
        revision,
        private_data: Setup {
            enhanced,
            ext,
            user,
        }
        .encode(),
    };
    fabric_api::sync::stream_sending(std::os::fd::AsFd::as_fd(&*sock));
    sock.write_all(&rep.encode())?;
    Ok(Negotiated {
        // An initiator offering version 1 speaks every feature: ours are what both use.
        features: ext.map_or(0, |x| x.features),
        crc,
        ord: our_ord(setup.enhanced),
        revision,
        peer_private,
        expect_send_rtr,
        peer_area,
        area,
        emu,
        peer_emu,
        initiator: false,
    })
}
