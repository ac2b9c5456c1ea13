//! The controller's end of an NVMe/TCP connection fed arbitrary steps: bytes from the host
//! (raw, or well-framed PDUs with arbitrary fields, so the fuzzer gets past the header
//! checks), and the controller's own requests (R2Ts, read data, completions). It never
//! panics; write data comes up only inside a range an R2T asked for, in order, at most
//! once; after the connection is over nothing more comes up; and what it sends reads back
//! on a host's deframer.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use nvme::sqe::{Sgl, Sqe};
use nvme::tcp::pdu::{data_digest, encode, DataHeader, Digests, Framing, Header, IcReq};
use nvme::tcp::{ControllerQueue, Deframer, Limits, QueueEvent, QueueSettings, Side};
use nvme::transport::WriteData;
use nvme::{Cqe, Status};

#[derive(Arbitrary, Debug)]
enum Step {
    Raw(Vec<u8>),
    IcReq {
        pfv: u8,
        hpda: u8,
        header_digest: bool,
        data_digest: bool,
        maxr2t: u8,
    },
    Command {
        cid: u8,
        len: u16,
        in_capsule: bool,
    },
    H2CData {
        cid: u8,
        ttag: u8,
        datao: u16,
        datal: u16,
        last: bool,
    },
    RequestData {
        cid: u8,
        offset: u16,
        len: u16,
    },
    SendData {
        cid: u8,
        len: u16,
        last: bool,
    },
    Complete(u8),
    /// Flips a byte of the next framed PDU.
    Corrupt(u8),
}

fuzz_target!(|steps: Vec<Step>| {
    let mut c = ControllerQueue::<Bytes>::new(QueueSettings::default());
    let mut framing = Framing::default();
    let mut host = Deframer::new(Side::Host);
    // Ranges asked by R2T: (cid, next offset, end).
    let mut asked: Vec<(u16, u32, u32)> = Vec::new();
    let mut corrupt: Option<u8> = None;
    let mut over = false;
    for step in steps.into_iter().take(64) {
        let framed = |h: Header, data: &[u8], framing: &Framing| -> Option<Vec<u8>> {
            let e = encode(&h, data.len() as u32, framing)?;
            let mut v = e.to_vec();
            v.extend_from_slice(data);
            if e.needs_data_digest() {
                v.extend_from_slice(&data_digest([data]));
            }
            Some(v)
        };
        let bytes = match step {
            Step::Raw(b) => Some(b),
            Step::IcReq {
                pfv,
                hpda,
                header_digest,
                data_digest,
                maxr2t,
            } => framed(
                Header::IcReq(IcReq {
                    pfv: u16::from(pfv % 2),
                    hpda: hpda % 40,
                    digests: Digests {
                        header: header_digest,
                        data: data_digest,
                    },
                    maxr2t: u32::from(maxr2t % 4),
                }),
                &[],
                &Framing::default(),
            ),
            Step::Command {
                cid,
                len,
                in_capsule,
            } => {
                let mut s = Sqe::new(0x01, u16::from(cid % 8));
                let len = u32::from(len % 10000);
                s.set_sgl(if in_capsule {
                    Sgl::in_capsule(0, len)
                } else {
                    Sgl::transport(len)
                });
                let data = if in_capsule {
                    vec![0u8; len as usize]
                } else {
                    Vec::new()
                };
                framed(Header::CapsuleCmd(s), &data, &framing)
            }
            Step::H2CData {
                cid,
                ttag,
                datao,
                datal,
                last,
            } => {
                let datal = u32::from(datal % 9000);
                framed(
                    Header::H2CData(DataHeader {
                        cccid: u16::from(cid % 8),
                        ttag: u16::from(ttag % 8),
                        datao: u32::from(datao),
                        datal,
                        last,
                        success: false,
                    }),
                    &vec![1u8; datal as usize],
                    &framing,
                )
            }
            Step::RequestData { cid, offset, len } => {
                let (cid, offset, len) = (u16::from(cid % 8), u32::from(offset), u32::from(len));
                if c.request_data(cid, offset, len).is_ok() {
                    asked.push((cid, offset, offset + len));
                }
                None
            }
            Step::SendData { cid, len, last } => {
                let data = Bytes::from(vec![2u8; usize::from(len % 9000)]);
                let _ = c.send_data(u16::from(cid % 8), 0, data, last, true);
                None
            }
            Step::Complete(cid) => {
                let cid = u16::from(cid % 8);
                if c.complete(Cqe::new(cid, Status::SUCCESS)).is_ok() {
                    asked.retain(|a| a.0 != cid);
                }
                None
            }
            Step::Corrupt(at) => {
                corrupt = Some(at);
                None
            }
        };
        if let Some(mut b) = bytes {
            if let (Some(at), false) = (corrupt.take(), b.is_empty()) {
                let i = usize::from(at) % b.len();
                b[i] ^= 0x5a;
            }
            c.receive(&b);
        }
        while let Some(e) = c.poll_event() {
            assert!(!over, "an event after the connection ended: {e:?}");
            match e {
                QueueEvent::Initialized(n) => {
                    framing = Framing {
                        digests: n.digests,
                        pda: 0,
                    };
                }
                QueueEvent::Data(WriteData {
                    cid,
                    offset,
                    data,
                    last,
                    ..
                }) => {
                    let end = offset + data.len() as u32;
                    let i = asked
                        .iter()
                        .position(|a| a.0 == cid && a.1 == offset && end <= a.2)
                        .expect("data nobody asked for");
                    asked[i].1 = end;
                    if last {
                        assert_eq!(end, asked[i].2, "last before the end");
                        asked.remove(i);
                    }
                }
                QueueEvent::Terminated(_) | QueueEvent::Failed { .. } => over = true,
                QueueEvent::Command(_) => {}
            }
        }
        // What the controller sends reads back on a host's deframer.
        while let Some(t) = c.poll_transmit() {
            for s in t.slices() {
                host.feed(s);
            }
            while let Some(p) = host.next_pdu().expect("the controller's PDUs read back") {
                if let Header::IcResp(r) = p.header {
                    host.set_limits(Limits {
                        digests: r.digests,
                        pda: 0,
                        max_data: 1 << 20,
                    });
                }
            }
        }
    }
});
