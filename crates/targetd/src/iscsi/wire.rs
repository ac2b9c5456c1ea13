//! PDUs on a TCP connection: the reader takes the BHS first and lets the caller put a SCSI
//! Command's immediate data or a Data-Out's payload straight into the task's arena buffer; the
//! writer sends headers and payload slices (arena slots, padding, digests) with vectored writes.

use std::future::Future;
use std::io::{self, IoSlice};
use std::ops::Range;
use std::task::Poll;
use std::time::{Duration, Instant};

use backend::Buffer;
use bytes::{BufMut, BytesMut};
use iscsi_pdu::target_node::Transmit;
use iscsi_pdu::{
    data_digest, padding, Bhs, DecodeError, Deframer, Digests, Opcode, Pdu, Received, RejectReason,
    SerialNumber,
};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// What reading a PDU can end in.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The socket failed or the peer closed it.
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// The header digest did not match: nothing after it can be trusted (close).
    #[error("header digest mismatch")]
    HeaderDigest,
    /// DataSegmentLength exceeds what this side declared (a protocol error: close).
    #[error("data segment of {length} bytes exceeds MaxRecvDataSegmentLength {limit}")]
    TooLong {
        /// What the header announced.
        length: u32,
        /// MaxRecvDataSegmentLength.
        limit: u32,
    },
    /// The PDU was read whole but is malformed or its data digest failed: answer with a Reject
    /// carrying its header and go on.
    #[error("rejected PDU: {reason:?}")]
    Reject {
        /// Why.
        reason: RejectReason,
        /// The offending header.
        header: Box<Bhs>,
    },
}

/// A PDU's header, decoded; for a SCSI Command with immediate data and for a Data-Out the data
/// segment is still on the wire and the caller reads it with [`Reader::payload`] or drops it
/// with [`Reader::discard`].
#[derive(Debug)]
pub enum Incoming {
    /// A whole PDU (its data segment, if any, inline).
    Whole(Pdu),
    /// A SCSI Command or Data-Out whose `len` bytes of data follow.
    Payload {
        /// The PDU, with an empty data segment.
        pdu: Pdu,
        /// The data segment's length.
        len: u32,
        /// The header as received, for a Reject.
        header: Bhs,
    },
}

/// The receiving half of a connection: an async shell around iscsi-pdu's [`Deframer`] in its
/// header-first mode, which makes every check (lengths, digests, decoding); this only moves
/// bytes from the socket into the deframer or, for a payload, straight into its destination.
pub struct Reader {
    rd: OwnedReadHalf,
    deframer: Deframer,
    /// When the last read off the socket returned ([`Reader::arrived`]).
    arrived: Instant,
}

/// Headers and control PDUs are read in chunks of up to this much; a payload with at least
/// this much left is read straight into its destination.
const READ_BUFFER: usize = 8192;

/// The PDUs whose payload goes straight to a task's buffer.
fn direct(op: Opcode) -> bool {
    matches!(op, Opcode::ScsiCommand | Opcode::DataOut)
}

impl Reader {
    /// Wraps the read half of a socket.
    pub fn new(rd: OwnedReadHalf) -> Reader {
        let mut deframer = Deframer::new();
        deframer.buffer_mut().reserve(2 * READ_BUFFER);
        Reader {
            rd,
            deframer,
            arrived: Instant::now(),
        }
    }

    /// When the last read off the socket returned: the arrival of every PDU it completed
    /// (with one read, a burst of commands arrives at once). A PDU [`Reader::next`] returns
    /// arrived then.
    pub fn arrived(&self) -> Instant {
        self.arrived
    }

    /// Wraps the read half of a handed-over connection's socket: `unread`, the bytes the
    /// other process had read and not made into PDUs, come first.
    pub fn resume(rd: OwnedReadHalf, unread: &[u8]) -> Reader {
        let mut r = Reader::new(rd);
        r.deframer.feed(unread);
        r
    }

    /// Switches digests on or off (after the login phase).
    pub fn set_digests(&mut self, digests: Digests) {
        self.deframer.set_digests(digests);
    }

    /// Sets the MaxRecvDataSegmentLength this side declared (after the login phase).
    pub fn set_max_recv(&mut self, len: u32) {
        self.deframer.set_max_recv_data_segment_length(len);
    }

    /// Reads what the socket has (at least one byte) into the deframer.
    async fn fill(&mut self) -> Result<(), ReadError> {
        let buf = self.deframer.buffer_mut();
        buf.reserve(READ_BUFFER);
        if self.rd.read_buf(buf).await? == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        self.arrived = Instant::now();
        Ok(())
    }

    /// The CmdSN the next PDU takes ([`Bhs::taken_cmd_sn`]), read from its header without
    /// taking the PDU: a park reads only the requests that fill a gap in the session's order.
    /// `None` when it takes none, or in the middle of a PDU. Waits for the header's bytes;
    /// cancel-safe.
    pub async fn peek_cmd_sn(&mut self) -> Result<Option<SerialNumber>, ReadError> {
        loop {
            let Some(unread) = self.deframer.unread() else {
                return Ok(None);
            };
            if let Some(header) = unread.first_chunk::<{ iscsi_pdu::BHS_LEN }>() {
                return Ok(Bhs(*header).taken_cmd_sn());
            }
            self.fill().await?;
        }
    }

    /// Reads the next PDU's header (and, except for payload-carrying PDUs, its data segment).
    pub async fn next(&mut self) -> Result<Incoming, ReadError> {
        loop {
            match self.try_next() {
                Some(r) => return r,
                None => self.fill().await?,
            }
        }
    }

    /// The next PDU if the bytes already read hold its header (and, for a PDU whose data is
    /// not read straight into a buffer, its data): what [`Reader::next`] would return at once,
    /// without reading the socket. `None` when more bytes are needed.
    pub fn try_next(&mut self) -> Option<Result<Incoming, ReadError>> {
        match self.deframer.next_header(direct) {
            Ok(Some(Received::Pdu(pdu))) => Some(Ok(Incoming::Whole(pdu))),
            Ok(Some(Received::Header { pdu, header, len })) => {
                Some(Ok(Incoming::Payload { pdu, len, header }))
            }
            Ok(None) => None,
            Err(e) => Some(Err(e.into())),
        }
    }

    /// Reads the payload announced by the last [`Incoming::Payload`] into `dst` (its length),
    /// then its padding and digest. A digest mismatch is a [`ReadError::Reject`]; the payload
    /// has been consumed either way.
    pub async fn payload(&mut self, dst: &mut [u8]) -> Result<(), ReadError> {
        let mut got = self.deframer.payload(dst);
        while got < dst.len() {
            if dst.len() - got >= READ_BUFFER {
                let n = self.rd.read(&mut dst[got..]).await?;
                if n == 0 {
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
                }
                self.deframer.payload_direct(&dst[got..got + n]);
                got += n;
            } else {
                self.fill().await?;
                got += self.deframer.payload(&mut dst[got..]);
            }
        }
        loop {
            match self.deframer.end_payload() {
                Ok(Some(())) => return Ok(()),
                Ok(None) => self.fill().await?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Drops the payload announced by the last [`Incoming::Payload`]; it is skipped as it
    /// arrives.
    pub fn discard(&mut self) {
        self.deframer.discard_payload();
    }

    /// The bytes read off the socket and not yet made into PDUs, between two PDUs (`None`
    /// while a payload is half read): what a handed-over connection goes on from.
    pub fn unread(&self) -> Option<&[u8]> {
        self.deframer.unread()
    }

    /// The connection's socket (for a handover, which passes a duplicate of it).
    pub fn socket(&self) -> &tokio::net::TcpStream {
        self.rd.as_ref()
    }
}

impl From<DecodeError> for ReadError {
    fn from(e: DecodeError) -> ReadError {
        match e {
            DecodeError::HeaderDigest { .. } => ReadError::HeaderDigest,
            DecodeError::DataSegmentTooLong { length, limit, .. } => {
                ReadError::TooLong { length, limit }
            }
            e => match e.reject() {
                Some((reason, header)) => ReadError::Reject {
                    reason,
                    header: Box::new(*header),
                },
                // Incomplete: the deframer asks for bytes instead of reporting it.
                None => ReadError::Io(io::Error::other(e.to_string())),
            },
        }
    }
}

/// One unit of output: the connection machine's transmit, over arena buffers.
pub type Outgoing = Transmit<Buffer>;

/// A piece of the next vectored write.
#[derive(Debug, Clone)]
enum Seg {
    /// Bytes of the header scratch buffer.
    Header(Range<usize>),
    /// Bytes of output item `usize`'s payload.
    Item(usize, Range<usize>),
    /// Zero padding.
    Pad(usize),
}

/// How many slices one `writev` carries.
const IOV_MAX: usize = 64;

/// The sending half of a connection.
pub struct Writer<W = OwnedWriteHalf> {
    wr: W,
    /// Digests in force.
    pub digests: Digests,
    /// The initiator's MaxRecvDataSegmentLength.
    pub max_send: u32,
    /// How long a send may wait for room in the socket before the connection is given up
    /// (`server.send_timeout`): the initiator has stopped reading.
    stall: Duration,
    headers: BytesMut,
    segs: Vec<Seg>,
}

/// Why a send failed when the socket had no room for `server.send_timeout`: the initiator stopped
/// reading. The connection ends; its buffers go back to the arena.
#[derive(Debug, thiserror::Error)]
#[error("nothing could be sent for {0:?}: the initiator stopped reading")]
pub struct SendStalled(pub Duration);

impl SendStalled {
    /// Whether `e` is a stalled send.
    pub fn is(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|inner| inner.is::<SendStalled>())
    }
}

impl<W: AsyncWrite + Unpin> Writer<W> {
    /// Wraps the write half of a socket; a send may wait `stall` for room in it.
    pub fn new(wr: W, stall: Duration) -> Writer<W> {
        Writer {
            wr,
            digests: Digests::NONE,
            max_send: iscsi_pdu::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH,
            stall,
            headers: BytesMut::with_capacity(16 * 1024),
            segs: Vec::with_capacity(256),
        }
    }

    /// Sends `items` in order, stamping ExpCmdSN and MaxCmdSN into Data-In headers, with as few
    /// system calls as the slices allow. The items are left for the caller to drop.
    pub async fn send(
        &mut self,
        items: &[Outgoing],
        exp_cmd_sn: SerialNumber,
        max_cmd_sn: SerialNumber,
    ) -> io::Result<()> {
        self.headers.clear();
        self.segs.clear();
        for (i, item) in items.iter().enumerate() {
            match item {
                Transmit::Pdu(pdu) => {
                    let len = pdu.data().len();
                    self.header(pdu, len);
                    self.data(i, 0..len, pdu.data());
                }
                Transmit::DataIn { payload, .. } => {
                    let max = self.max_send;
                    for (pdu, range) in item.data_in_pdus(max, exp_cmd_sn, max_cmd_sn) {
                        self.header(&pdu, range.len());
                        let bytes = &payload.as_slice()[range.clone()];
                        self.data(i, range, bytes);
                    }
                }
            }
        }
        self.flush(items).await
    }

    fn header(&mut self, pdu: &Pdu, data_len: usize) {
        let start = self.headers.len();
        pdu.encode_header(data_len as u32, self.digests.header, &mut self.headers);
        self.push_header(start);
    }

    /// Adds the header bytes from `start` to the end, merging with a header segment just before.
    fn push_header(&mut self, start: usize) {
        let end = self.headers.len();
        if let Some(Seg::Header(r)) = self.segs.last_mut() {
            if r.end == start {
                r.end = end;
                return;
            }
        }
        self.segs.push(Seg::Header(start..end));
    }

    fn data(&mut self, item: usize, range: Range<usize>, bytes: &[u8]) {
        if range.is_empty() {
            return;
        }
        let pad = padding(range.len()).len();
        self.segs.push(Seg::Item(item, range));
        if pad > 0 {
            self.segs.push(Seg::Pad(pad));
        }
        if self.digests.data {
            let start = self.headers.len();
            self.headers.put_u32_le(data_digest([bytes]));
            self.push_header(start);
        }
    }

    async fn flush(&mut self, items: &[Outgoing]) -> io::Result<()> {
        const ZEROS: [u8; 4] = [0; 4];
        let mut at = 0;
        while at < self.segs.len() {
            let mut iov = [IoSlice::new(&[]); IOV_MAX];
            let mut n = 0;
            while n < IOV_MAX && at < self.segs.len() {
                iov[n] = IoSlice::new(match &self.segs[at] {
                    Seg::Header(r) => &self.headers[r.clone()],
                    Seg::Item(i, r) => match &items[*i] {
                        Transmit::Pdu(p) => &p.data()[r.clone()],
                        Transmit::DataIn { payload, .. } => &payload.as_slice()[r.clone()],
                    },
                    Seg::Pad(p) => &ZEROS[..*p],
                });
                n += 1;
                at += 1;
            }
            write_all_vectored(&mut self.wr, &mut iov[..n], self.stall).await?;
        }
        self.wr.flush().await
    }

    /// Sends one PDU at once (login, discovery, shutdown).
    pub async fn send_pdu(&mut self, pdu: Pdu) -> io::Result<()> {
        let items = [Transmit::Pdu(pdu)];
        self.send(&items, SerialNumber(0), SerialNumber(0)).await
    }

    /// Shuts the sending direction down.
    pub async fn shutdown(&mut self) -> io::Result<()> {
        self.wr.shutdown().await
    }
}

impl Writer {
    /// Lets the socket go without shutting its sending direction down (which dropping the
    /// write half would do, and which would end the connection for every process holding
    /// it): another process serves the connection now. Only the descriptor is closed, with
    /// the read half.
    pub fn release(self) {
        self.wr.forget();
    }
}

/// Writes every slice, resuming after short writes; fails with [`SendStalled`] when the socket
/// has had no room for `stall`.
pub async fn write_all_vectored<W: AsyncWrite + Unpin>(
    wr: &mut W,
    mut iov: &mut [IoSlice<'_>],
    stall: Duration,
) -> io::Result<()> {
    while !iov.is_empty() {
        // The socket usually has room: no timer then (the timer is armed only to wait).
        let n = match poll_once(wr.write_vectored(iov)).await {
            Some(r) => r?,
            None => tokio::time::timeout(stall, wr.write_vectored(iov))
                .await
                .map_err(|_| io::Error::other(SendStalled(stall)))??,
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut iov, n);
    }
    Ok(())
}

/// Polls `f` once: its output if it is ready now, `None` if it would wait.
async fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| match f.as_mut().poll(cx) {
        Poll::Ready(v) => Poll::Ready(Some(v)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}
