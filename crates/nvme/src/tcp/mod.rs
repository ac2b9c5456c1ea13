//! NVMe/TCP (NVM Express TCP Transport Specification 1.0): PDUs and their framing
//! ([`pdu`]), and the streaming [`Deframer`] a receiving end feeds.
//!
//! A connection starts with ICReq and ICResp, in which the host and the controller agree
//! on digests and data alignment and the controller declares MAXH2CDATA; from then on the
//! host sends command capsules (with in-capsule data up to the controller's I/O queue
//! command capsule size) and H2CData answering R2Ts, and the controller sends response
//! capsules, C2HData and R2Ts. An error in a PDU header ends the connection with a TermReq
//! whose Fatal Error Status names it.
//!
//! [`ControllerConnection`] (the transport-free part of a controller's connection, over
//! [`ControllerQueue`]) is the controller's end with its commands carried out: the queue
//! machine joined to the subsystem and to the block operations a shell runs.

pub mod connection;
pub mod deframer;
pub mod host;
pub mod pdu;
pub mod queue;

pub use connection::ControllerConnection;
pub use deframer::{DeframeError, Deframer, Limits, Pdu, Side};
pub use host::{HostEvent, HostQueue, HostSettings};
pub use pdu::{
    data_digest, encode, DataHeader, Digests, EncodedHeader, FatalError, Framing, Header, IcReq,
    IcResp, PduType, R2t, TermReq,
};
pub use queue::{
    ControllerQueue, Negotiated, Payload, QueueError, QueueEvent, QueueSettings, Transmit,
};
