import tempfile

from langchain_chroma import Chroma
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_ragblend import ChatRagBlend, MiniLMEmbeddings

docs = [
    Document(page_content="Hannibal and Scipio is a stage play written by Thomas Nabbes in 1635."),
    Document(page_content="Thomas Nabbes was an English dramatist educated at Exeter College."),
    Document(page_content="Exeter College is a college of the University of Oxford, founded 1314."),
]
llm = ChatRagBlend(model="embedded")
vectorstore = Chroma.from_documents(docs, MiniLMEmbeddings(), persist_directory=tempfile.mkdtemp())
retriever = vectorstore.as_retriever(search_kwargs={"k": 3})
llm.warm(docs)  # background KV precompute of every chunk (at ingestion)
llm.wait_for_warmup()

prompt = ChatPromptTemplate.from_template(
    "Answer the question from the context.\nContext: {context}\nQuestion: {question}\nAnswer:"
)


def format_docs(docs):
    return "\n\n".join(doc.page_content for doc in docs)


chain = (
    {"context": retriever | format_docs, "question": RunnablePassthrough()}
    | prompt
    | llm
    | StrOutputParser()
)
print(chain.invoke("Where was the author of Hannibal and Scipio educated?"))
